//! Wire protocol v2: negotiated next to v1, typed layouts, tokens, sessions and heartbeats.
//!
//! ```text
//! server -> client, on accept:  open server:  v1 handshake | OFFER      (one write)
//!                               token server: OFFER
//! OFFER (38 bytes):             b"ECHO" | 0x02 | mode: b'o' (open) or b't' (token) | nonce: 32
//!                               ASCII hex digits (16 random bytes). No byte of it is 0x01, so a
//!                               v1 client counting 0x01 acks is not confused by it.
//! client -> server, HELLO:      nonce (32, echoed) | b"ECHO" | 0x02 | body_len: u32 | body
//!   body:                       flags: u8 (bit 0: MAC at the end; bit 1: shared memory
//!                               wanted; bit 2: closing notices understood; bit 3: compressed
//!                               frames understood; bit 4: durable, the client keeps each
//!                               sample until it is persisted; bit 5: the client may fetch
//!                               parameters, see [`super::params`]; bit 6: the client
//!                               appends each sample's policy version when asked) | session:
//!                               16 bytes
//!                               | first_seq: u64 | heartbeat_ms: u32 | client_nonce: 16 bytes
//!                               | n_leaves: u32 | per leaf: name_len: u16 | name (UTF-8)
//!                               | byte order: u8 | kind: u8 | itemsize: u32 | ndim: u32
//!                               | ndim x dim: u32 | [mac: 32 bytes]
//! server -> client, REPLY:      b"ECHO" | 0x02 | status: u8 | msg_len: u32 | msg (UTF-8)
//!   status 0 (accepted), then:  flags: u8 (bit 0: replay, priorities accepted; bit 1: MAC;
//!                               bit 2: shared memory offered; bit 3: a sequence table, step
//!                               frames accepted; bit 4: codecs follow; bit 5: persisted
//!                               notices follow, to a client that set hello bit 4; bit 6:
//!                               parameter fetches served, to a client that set hello bit 5;
//!                               bit 7: policy versions kept, to a client that set hello bit
//!                               6: every payload ends with its sample's version, u64)
//!                               | resume_seq: u64
//!                               | heartbeat_ms: u32 | [mac: 32 bytes]
//!                               | [name_len: u8 | socket name | shm nonce: 16 bytes]
//!                               | [max_rows: u32, with bit 3]
//!                               | [n_leaves: u32 | per leaf: codec: u8 (0 raw, 1 zstd,
//!                               2 lz4) | level: i8, with bit 4; only to a client that set
//!                               hello bit 3]
//!                               | [admit: u64, with bit 7: a client more than `admit`
//!                               versions behind the latest waits for newer parameters
//!                               before it sends; u64::MAX: never]
//!                               (msg, empty otherwise, says why shared memory was wanted
//!                               and not offered)
//! client -> server, frames:     0x10 payload | 0x11 priority: f64 | payload
//!                               | 0x12 row: u32 | end: u8 | payload
//!                               | 0x13 row: u32 | end: u8 | priority: f64 | payload
//!                               | 0x14..=0x17: 0x10..=0x13 with their leaves compressed:
//!                               the same fields, then body_len: u32 | body (only after
//!                               reply bit 4)
//!                               | 0x20 (heartbeat) | 0x30 (bye: the session is over)
//!                               | 0x31 (no shared memory after all: samples come as frames)
//! server -> client, bytes:      0x01 (ack: one sample queued) | 0x02 (heartbeat)
//!                               | 0x03 msg_len: u32 | msg (error; the server then closes)
//!                               | 0x04 reason: u8 (closing: 1 for good, 2 restarting; only to
//!                               a client that set hello bit 2, after its last ack; the
//!                               server then reads nothing more and closes)
//!                               | 0x05 seq: u64 (persisted: every sample of the session
//!                               before `seq` is in a completed checkpoint; only after reply
//!                               bit 5, after the acks of those samples)
//! ```
//!
//! All integers are little-endian. The k-th sample frame of a connection has sequence number
//! `resume_seq + k`. A step frame (0x12, 0x13; only to a server that set bit 3) is a sample of
//! the client's stream `row` (row `i` of a `send_batch`; `row < max_rows`), and `end` says
//! whether it ends its episode: 0 no, 1 terminated, 2 truncated. 0x10 and 0x11 are row 0,
//! episode going on. MACs are HMAC-SHA256 keyed by the token: the client's covers
//! `b"echo-v2-client" | server nonce | body without the MAC`, the server's
//! `b"echo-v2-server" | client_nonce | server nonce | resume_seq`; the token never crosses the
//! wire. Decoding is defensive: lengths are capped before anything is allocated.
//!
//! A compressed frame's body is the leaves the server left raw, in order, then the leaves its
//! reply named compressed, packed as [`crate::codec`] packs a stored item (one u32 length per
//! compressed leaf, then their bytes). The server caps `body_len` at the raw leaves plus each
//! compressed leaf's worst-case size, and decompresses each leaf into exactly its size: a
//! truncated, oversized or corrupt body ends the connection with an error frame.

use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;

pub use super::layout::{DType, Layout, LeafType};
use super::reader::{count, Cursor};
use crate::codec::Codec;
use crate::error::EchoError;
use crate::source::EpisodeEnd;

/// The version byte of every v2 message.
pub const VERSION: u8 = 2;
/// Length of the server's nonce on the wire (hex digits).
pub const NONCE_LEN: usize = 32;
/// Length of an OFFER.
pub const OFFER_LEN: usize = 4 + 1 + 1 + NONCE_LEN;
/// Length of a MAC.
pub const MAC_LEN: usize = 32;

/// Client frame: a sample follows.
pub const SAMPLE: u8 = 0x10;
/// Client frame: a priority (f64) and a sample follow.
pub const SAMPLE_PRIORITY: u8 = 0x11;
/// Client frame: a row (u32), an episode flag (u8) and a sample follow.
pub const STEP: u8 = 0x12;
/// Client frame: a row (u32), an episode flag (u8), a priority (f64) and a sample follow.
pub const STEP_PRIORITY: u8 = 0x13;
/// Client frame, and server byte [`BEAT`]: nothing follows; "still here".
pub const HEARTBEAT: u8 = 0x20;
/// Client frame: the client is done; the server forgets the session.
pub const BYE: u8 = 0x30;
/// Client frame: the client could not attach the shared memory it was offered; its samples
/// come as frames on this connection.
pub const SHM_DECLINE: u8 = 0x31;
/// Hello flag: the client wants the same-host shared-memory path.
pub const HELLO_SHM: u8 = 2;
/// Reply flag: a shared-memory offer follows the MAC.
pub const REPLY_SHM: u8 = 4;
/// Reply flag: the server is a sequence table and takes step frames; `max_rows` follows.
pub const REPLY_STEPS: u8 = 8;
/// Length of the shared-memory nonce.
pub const SHM_NONCE_LEN: usize = 16;
/// Server byte: one sample queued (the same byte as v1's ack).
pub const ACK: u8 = super::ACK;
/// Server byte: heartbeat.
pub const BEAT: u8 = 0x02;
/// Server byte: an error message follows, then the server closes.
pub const ERROR: u8 = 0x03;
/// Server byte: the server is closing (a [`Closing`] reason byte follows): every sample it
/// acknowledged was acknowledged before it; nothing after it is.
pub const CLOSING: u8 = 0x04;
/// Hello flag: the client understands [`CLOSING`].
pub const HELLO_NOTICES: u8 = 4;
/// Hello flag: the client sends compressed frames when the reply names codecs.
pub const HELLO_CODECS: u8 = 8;
/// Reply flag: per-leaf codecs follow (compressed frames accepted).
pub const REPLY_CODECS: u8 = 16;
/// Hello flag: the client keeps every sample until a [`PERSISTED`] notice covers it, and
/// resends from wherever a restored server's session stands.
pub const HELLO_DURABLE: u8 = 16;
/// Reply flag: the server sends [`PERSISTED`] notices on this connection.
pub const REPLY_DURABLE: u8 = 32;
/// Hello flag: the client may fetch the learner's parameters and hears of new versions
/// ([`super::params`]).
pub const HELLO_PARAMS: u8 = 32;
/// Reply flag: the server serves parameter fetches on this connection and sends version
/// notices.
pub const REPLY_PARAMS: u8 = 64;
/// Hello flag: the client appends the policy version of every sample to its payload when
/// the server keeps versions ([`crate::versions`]).
pub const HELLO_VERSIONS: u8 = 64;
/// Reply flag: the server keeps policy versions: every payload on this connection ends with
/// the sample's version (u64), and the admission bound (u64) follows the codecs.
pub const REPLY_VERSIONS: u8 = 128;
/// Server byte: a sequence number (u64) follows; every sample of the session before it is in
/// a completed checkpoint.
pub const PERSISTED: u8 = 0x05;
/// Length of a [`PERSISTED`] notice.
pub const PERSISTED_LEN: usize = 9;

/// A [`PERSISTED`] notice's bytes.
pub fn encode_persisted(seq: u64) -> [u8; PERSISTED_LEN] {
    let mut out = [0u8; PERSISTED_LEN];
    out[0] = PERSISTED;
    out[1..].copy_from_slice(&seq.to_le_bytes());
    out
}

/// The sequence number of the [`PERSISTED`] notice `bytes` start with (its kind byte
/// included); `None` until all [`PERSISTED_LEN`] bytes are there, or if they are not one.
pub fn parse_persisted(bytes: &[u8]) -> Option<u64> {
    match bytes.get(..PERSISTED_LEN)? {
        [PERSISTED, seq @ ..] => Some(u64::from_le_bytes(seq.try_into().ok()?)),
        _ => None,
    }
}
/// Frame-kind flag: a sample frame (0x10..=0x13) whose leaves come compressed.
pub const PACKED: u8 = 0x04;

/// Why a server closes, as its [`CLOSING`] notice says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closing {
    /// For good (`Server.close()`): reconnecting is pointless.
    Final = 1,
    /// It comes back (`Server.close(restarting=True)`): reconnecting clients keep trying.
    Restarting = 2,
}

impl Closing {
    /// The reason a notice's byte gives; `None` for a byte that is not one.
    pub fn from_byte(byte: u8) -> Option<Self> {
        match byte {
            1 => Some(Self::Final),
            2 => Some(Self::Restarting),
            _ => None,
        }
    }
}

/// Reply status: accepted.
pub const ACCEPTED: u8 = 0;
/// The most bytes of an error or refusal message.
pub const MAX_MESSAGE: u32 = 64 * 1024;

/// When one side sends heartbeats and when it gives up on a silent peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Beat {
    /// Send a heartbeat after this long without writing.
    pub every: Duration,
    /// The peer is dead after this long without a byte from it (`None`: never).
    pub dead_after: Option<Duration>,
}

impl Beat {
    /// From this side's timeout and the peer's (in ms as the handshake carries it, 0 = none):
    /// write at least four times per the shorter of the two, give up after our own. `None`
    /// when neither side has one.
    pub fn new(own: Option<Duration>, peer_ms: u32) -> Option<Self> {
        let peer = (peer_ms > 0).then(|| Duration::from_millis(u64::from(peer_ms)));
        let shortest = match (own, peer) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b)?,
        };
        Some(Self { every: (shortest / 4).max(Duration::from_millis(10)), dead_after: own })
    }
}

/// Why a server refused a hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Malformed hello or an unsupported request.
    Protocol = 1,
    /// Missing or wrong token.
    Auth = 2,
    /// The client's samples are not shaped like the server's.
    Layout = 3,
}

impl Refusal {
    fn from_status(status: u8) -> Option<Self> {
        match status {
            1 => Some(Self::Protocol),
            2 => Some(Self::Auth),
            3 => Some(Self::Layout),
            _ => None,
        }
    }

    /// The error a client reports for this refusal.
    pub fn into_error(self, message: String) -> EchoError {
        match self {
            Self::Auth => EchoError::Auth(message),
            Self::Protocol | Self::Layout => EchoError::Protocol(message),
        }
    }
}

/// Whether a server needs a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// v1 and v2 clients, no token.
    Open,
    /// v2 clients that prove the token.
    Token,
}

/// The server's offer of v2: its mode and a fresh nonce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    /// Whether a token is required.
    pub mode: Mode,
    /// 32 ASCII hex digits.
    pub nonce: [u8; NONCE_LEN],
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// `N` random bytes from the operating system.
///
/// # Errors
/// [`EchoError::Io`] if the OS has no randomness to give.
pub fn random<const N: usize>() -> Result<[u8; N], EchoError> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes)
        .map_err(|e| EchoError::Io(std::io::Error::other(format!("no OS randomness: {e}"))))?;
    Ok(bytes)
}

impl Offer {
    /// An offer with a fresh random nonce.
    ///
    /// # Errors
    /// As [`random`].
    pub fn new(mode: Mode) -> Result<Self, EchoError> {
        let raw: [u8; NONCE_LEN / 2] = random()?;
        let mut nonce = [0u8; NONCE_LEN];
        for (i, byte) in raw.iter().enumerate() {
            nonce[2 * i] = HEX[usize::from(byte >> 4)];
            nonce[2 * i + 1] = HEX[usize::from(byte & 15)];
        }
        Ok(Self { mode, nonce })
    }

    /// The offer's bytes.
    pub fn encode(&self) -> [u8; OFFER_LEN] {
        let mut out = [0u8; OFFER_LEN];
        out[..4].copy_from_slice(super::MAGIC);
        out[4] = VERSION;
        out[5] = match self.mode {
            Mode::Open => b'o',
            Mode::Token => b't',
        };
        out[6..].copy_from_slice(&self.nonce);
        out
    }

    /// Parses an offer at the start of `bytes`: `Ok(None)` if fewer than [`OFFER_LEN`] bytes
    /// are there yet (and what is there is a valid start).
    ///
    /// # Errors
    /// [`EchoError::Protocol`] if the bytes are not an offer.
    pub fn parse(bytes: &[u8]) -> Result<Option<Self>, EchoError> {
        let bad = |what: String| {
            EchoError::Protocol(format!(
                "not an echo server: a wire version 2 greeting must be an offer, got {what}"
            ))
        };
        super::check_magic(bytes)?;
        if bytes.len() > 4 && bytes[4] != VERSION {
            return Err(bad(format!("version {}", bytes[4])));
        }
        let mode = match bytes.get(5) {
            None => return Ok(None),
            Some(b'o') => Mode::Open,
            Some(b't') => Mode::Token,
            Some(other) => return Err(bad(format!("mode byte {other:#04x}"))),
        };
        let Some(nonce) = bytes.get(6..OFFER_LEN) else { return Ok(None) };
        if let Some(bad_digit) = nonce.iter().find(|b| !HEX.contains(b)) {
            return Err(bad(format!("nonce byte {bad_digit:#04x} is not a hex digit")));
        }
        Ok(Some(Self { mode, nonce: nonce.try_into().expect("32 bytes") }))
    }
}

/// A client's hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The client's session, the same across its reconnects.
    pub session: [u8; 16],
    /// Samples of this session the client has had acknowledged.
    pub first_seq: u64,
    /// The client's dead-peer timeout in milliseconds (0: none).
    pub heartbeat_ms: u32,
    /// The client's nonce, for the server's proof.
    pub client_nonce: [u8; 16],
    /// The client's samples.
    pub layout: Layout,
    /// The client's proof of the token, if it has one.
    pub mac: Option<[u8; MAC_LEN]>,
    /// The client wants the same-host shared-memory path.
    pub shm: bool,
    /// The client understands [`CLOSING`] notices.
    pub notices: bool,
    /// The client sends compressed frames when the reply names codecs.
    pub codecs: bool,
    /// The client keeps its samples until they are persisted ([`HELLO_DURABLE`]).
    pub durable: bool,
    /// The client may fetch parameters ([`HELLO_PARAMS`]).
    pub params: bool,
    /// The client appends policy versions to its payloads if asked ([`HELLO_VERSIONS`]).
    pub versions: bool,
}

/// Fixed bytes of a hello before its body: nonce, magic, version, body length.
const HELLO_HEAD: usize = NONCE_LEN + 4 + 1 + 4;
/// Fixed bytes of a hello body before the layout.
const BODY_FIXED: usize = 1 + 16 + 8 + 4 + 16;

fn hmac(token: &[u8]) -> Hmac<Sha256> {
    // HMAC takes keys of any length.
    Hmac::<Sha256>::new_from_slice(token).expect("HMAC accepts keys of any length")
}

impl Hello {
    /// The hello's bytes, answering `offer`; with `token`, signed.
    ///
    /// # Errors
    /// [`EchoError::Config`] if the layout does not fit the format.
    pub fn encode(&self, offer: &Offer, token: Option<&[u8]>) -> Result<Vec<u8>, EchoError> {
        let mut body = Vec::with_capacity(BODY_FIXED + self.layout.encoded_len() + MAC_LEN);
        body.push(
            u8::from(token.is_some())
                | if self.shm { HELLO_SHM } else { 0 }
                | if self.notices { HELLO_NOTICES } else { 0 }
                | if self.codecs { HELLO_CODECS } else { 0 }
                | if self.durable { HELLO_DURABLE } else { 0 }
                | if self.params { HELLO_PARAMS } else { 0 }
                | if self.versions { HELLO_VERSIONS } else { 0 },
        );
        body.extend_from_slice(&self.session);
        body.extend_from_slice(&self.first_seq.to_le_bytes());
        body.extend_from_slice(&self.heartbeat_ms.to_le_bytes());
        body.extend_from_slice(&self.client_nonce);
        self.layout.encode_into(&mut body)?;
        if let Some(token) = token {
            let mut mac = hmac(token);
            mac.update(b"echo-v2-client");
            mac.update(&offer.nonce);
            mac.update(&body);
            body.extend_from_slice(&mac.finalize().into_bytes());
        }
        let mut out = Vec::with_capacity(HELLO_HEAD + body.len());
        out.extend_from_slice(&offer.nonce);
        out.extend_from_slice(super::MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&count(body.len(), "hello size")?.to_le_bytes());
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// Whether `token` signed this hello (constant-time comparison).
    pub fn verify(&self, offer: &Offer, token: &[u8], body: &[u8]) -> bool {
        let Some(mac) = &self.mac else { return false };
        let mut check = hmac(token);
        check.update(b"echo-v2-client");
        check.update(&offer.nonce);
        check.update(&body[..body.len() - MAC_LEN]);
        check.verify_slice(mac).is_ok()
    }
}

/// What the first bytes a client sent are.
#[derive(Debug)]
pub enum Opening {
    /// Not a hello: v1 sample data (they do not start with the offer's nonce).
    V1,
    /// A strict prefix of a hello so far: read more.
    NeedMore,
    /// A whole hello: it, its body (for [`Hello::verify`]) and its length on the wire.
    Hello(Box<Hello>, Vec<u8>, usize),
}

/// Tells a hello from v1 sample data in the first bytes a client sent, and parses it.
/// `max_body` caps the body length a hello may announce (the server sizes it from its own
/// layout, so a peer cannot make it buffer much).
///
/// # Errors
/// [`EchoError::Protocol`] for a malformed hello (one that starts with the nonce).
pub fn parse_opening(
    received: &[u8],
    offer: &Offer,
    max_body: usize,
) -> Result<Opening, EchoError> {
    let n = received.len().min(NONCE_LEN);
    if received[..n] != offer.nonce[..n] {
        return Ok(Opening::V1);
    }
    if received.len() < HELLO_HEAD {
        let magic = &received[n..];
        super::check_magic(magic)?;
        return Ok(Opening::NeedMore);
    }
    let head = &received[NONCE_LEN..HELLO_HEAD];
    super::check_magic(&head[..4])?;
    if head[4] != VERSION {
        return Err(EchoError::Protocol(format!("hello version {}, expected {VERSION}", head[4])));
    }
    let body_len = u32::from_le_bytes(head[5..9].try_into().expect("4 bytes")) as usize;
    if body_len > max_body {
        return Err(EchoError::Protocol(format!(
            "hello of {body_len} bytes, more than the {max_body} this server's layout needs"
        )));
    }
    let Some(body) = received.get(HELLO_HEAD..HELLO_HEAD + body_len) else {
        return Ok(Opening::NeedMore);
    };
    let hello = decode_body(body)?;
    Ok(Opening::Hello(Box::new(hello), body.to_vec(), HELLO_HEAD + body_len))
}

fn decode_body(body: &[u8]) -> Result<Hello, EchoError> {
    let mut reader = Cursor(body);
    let flags = reader.u8()?;
    let session = reader.array::<16>()?;
    let first_seq = reader.u64()?;
    let heartbeat_ms = reader.u32()?;
    let client_nonce = reader.array::<16>()?;
    let layout = Layout::decode(&mut reader)?;
    let mac = if flags & 1 != 0 { Some(reader.array::<MAC_LEN>()?) } else { None };
    if !reader.0.is_empty() {
        return Err(EchoError::Protocol(format!(
            "hello has {} bytes after its end",
            reader.0.len()
        )));
    }
    let shm = flags & HELLO_SHM != 0;
    let notices = flags & HELLO_NOTICES != 0;
    let codecs = flags & HELLO_CODECS != 0;
    let durable = flags & HELLO_DURABLE != 0;
    let params = flags & HELLO_PARAMS != 0;
    let versions = flags & HELLO_VERSIONS != 0;
    Ok(Hello {
        session,
        first_seq,
        heartbeat_ms,
        client_nonce,
        layout,
        mac,
        shm,
        notices,
        codecs,
        durable,
        params,
        versions,
    })
}

/// The most bytes a hello body for `layout` may have: its exact size with a MAC, doubled
/// (names may differ in length), plus 64 KiB.
pub fn max_hello_body(layout: &Layout) -> usize {
    (BODY_FIXED + layout.encoded_len() + MAC_LEN) * 2 + 64 * 1024
}

/// A server's acceptance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accept {
    /// The backend is a replay table: sample frames may carry priorities.
    pub replay: bool,
    /// The sequence number of the first sample the server wants on this connection.
    pub resume_seq: u64,
    /// The server's dead-peer timeout in milliseconds (0: none).
    pub heartbeat_ms: u32,
    /// The server's proof of the token, if it has one.
    pub mac: Option<[u8; MAC_LEN]>,
    /// The shared-memory channel offered to a client that wanted one.
    pub shm: Option<ShmOffer>,
    /// Why a client that wanted shared memory was not offered it (empty otherwise).
    pub note: String,
    /// `Some(max_rows)`: the server is a sequence table and takes step frames of rows
    /// `0..max_rows`.
    pub steps: Option<u32>,
    /// `Some(per leaf)`: the server takes compressed frames with these leaves compressed so.
    pub codecs: Option<Vec<Option<Codec>>>,
    /// The server sends [`PERSISTED`] notices on this connection (to a durable client).
    pub durable: bool,
    /// The server serves parameter fetches on this connection ([`REPLY_PARAMS`]).
    pub params: bool,
    /// `Some(admit)`: the server keeps policy versions ([`REPLY_VERSIONS`]), and a client
    /// whose version is more than `admit` behind the latest waits for newer parameters
    /// before it sends (`u64::MAX`: it never waits).
    pub versions: Option<u64>,
}

/// What a sample frame carries besides its payload: a priority, and for a sequence table the
/// row (the client's stream) and the episode flag. The one definition of the frame headers:
/// the client encodes them, the server and the shared-memory slots decode them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct FrameMeta {
    /// The sample's own priority (replay and sequence tables).
    pub priority: Option<f64>,
    /// The client's row (stream) the sample is a step of.
    pub row: u32,
    /// Whether the step ends its episode.
    pub end: EpisodeEnd,
}

impl FrameMeta {
    /// The longest frame header: kind, row, flag and priority.
    pub const MAX_HEADER: usize = 1 + 4 + 1 + 8;

    /// Whether the frame needs a step frame (a row other than 0 or an episode end).
    pub fn is_step(&self) -> bool {
        self.row != 0 || self.end != EpisodeEnd::No
    }

    /// The frame's header (`header[..len]`): its kind byte and fields.
    pub fn encode(&self) -> ([u8; Self::MAX_HEADER], usize) {
        self.encode_as(false)
    }

    /// [`FrameMeta::encode`], as a step frame even for row 0 going on when `step` (so that
    /// every frame of a batch to a sequence table has the same length).
    pub fn encode_as(&self, step: bool) -> ([u8; Self::MAX_HEADER], usize) {
        let mut header = [0u8; Self::MAX_HEADER];
        let mut at = 1;
        if step || self.is_step() {
            header[0] = if self.priority.is_some() { STEP_PRIORITY } else { STEP };
            header[1..5].copy_from_slice(&self.row.to_le_bytes());
            header[5] = self.end.code();
            at = 6;
        } else {
            header[0] = if self.priority.is_some() { SAMPLE_PRIORITY } else { SAMPLE };
        }
        if let Some(p) = self.priority {
            header[at..at + 8].copy_from_slice(&p.to_le_bytes());
            at += 8;
        }
        (header, at)
    }

    /// Bytes after the kind byte of a sample frame of `kind`, before its payload; `None` if
    /// `kind` is not a sample frame.
    pub fn rest_len(kind: u8) -> Option<usize> {
        match kind {
            SAMPLE => Some(0),
            SAMPLE_PRIORITY => Some(8),
            STEP => Some(5),
            STEP_PRIORITY => Some(13),
            _ => None,
        }
    }

    /// The fields of a sample frame of `kind` from the `rest_len(kind)` bytes after its kind.
    ///
    /// # Errors
    /// [`EchoError::Protocol`] for a kind that is not a sample frame, the wrong length, or an
    /// episode flag other than 0, 1 and 2.
    pub fn decode(kind: u8, rest: &[u8]) -> Result<Self, EchoError> {
        let expected = Self::rest_len(kind)
            .ok_or_else(|| EchoError::Protocol(format!("unknown frame type {kind:#04x}")))?;
        if rest.len() != expected {
            return Err(EchoError::Protocol(format!(
                "frame {kind:#04x}: expected {expected} header bytes, got {}",
                rest.len()
            )));
        }
        let mut meta = Self::default();
        let mut reader = Cursor(rest);
        if matches!(kind, STEP | STEP_PRIORITY) {
            meta.row = reader.u32()?;
            let code = reader.u8()?;
            meta.end = EpisodeEnd::from_code(code).ok_or_else(|| {
                EchoError::Protocol(format!(
                    "a step's episode flag is 0, 1 or 2 (goes on, terminated, truncated), got \
                     {code}"
                ))
            })?;
        }
        if matches!(kind, SAMPLE_PRIORITY | STEP_PRIORITY) {
            meta.priority = Some(f64::from_le_bytes(reader.array()?));
        }
        Ok(meta)
    }

    /// Splits a whole frame (`kind | header | payload`, as a client keeps it to resend) into
    /// its fields and payload.
    ///
    /// # Errors
    /// As [`FrameMeta::decode`], or a frame shorter than its header.
    pub fn split(frame: &[u8]) -> Result<(Self, &[u8]), EchoError> {
        let (&kind, rest) =
            frame.split_first().ok_or_else(|| EchoError::Protocol("an empty frame".into()))?;
        let len = Self::rest_len(kind)
            .ok_or_else(|| EchoError::Protocol(format!("unknown frame type {kind:#04x}")))?;
        if rest.len() < len {
            return Err(EchoError::Protocol(format!("frame {kind:#04x} shorter than its header")));
        }
        let (header, payload) = rest.split_at(len);
        Ok((Self::decode(kind, header)?, payload))
    }
}

/// Where a client attaches the shared-memory channel it was offered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmOffer {
    /// The abstract Unix socket name (without the leading NUL), at most 255 bytes.
    pub name: Vec<u8>,
    /// What the client presents on that socket.
    pub nonce: [u8; SHM_NONCE_LEN],
}

/// A server's answer to a hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Accepted.
    Accepted(Accept),
    /// Refused, and why.
    Refused(Refusal, String),
}

fn server_mac(token: &[u8], hello: &Hello, offer: &Offer, resume_seq: u64) -> Hmac<Sha256> {
    let mut mac = hmac(token);
    mac.update(b"echo-v2-server");
    mac.update(&hello.client_nonce);
    mac.update(&offer.nonce);
    mac.update(&resume_seq.to_le_bytes());
    mac
}

impl Accept {
    /// An acceptance of `hello`, signed with `token` if the server has one.
    pub fn new(
        replay: bool,
        resume_seq: u64,
        heartbeat_ms: u32,
        signed: Option<(&[u8], &Hello, &Offer)>,
    ) -> Self {
        let mac = signed.map(|(token, hello, offer)| {
            server_mac(token, hello, offer, resume_seq).finalize().into_bytes().into()
        });
        Self {
            replay,
            resume_seq,
            heartbeat_ms,
            mac,
            shm: None,
            note: String::new(),
            steps: None,
            codecs: None,
            durable: false,
            params: false,
            versions: None,
        }
    }

    /// Whether the server proved `token` (constant-time comparison).
    pub fn verify(&self, token: &[u8], hello: &Hello, offer: &Offer) -> bool {
        let Some(mac) = &self.mac else { return false };
        server_mac(token, hello, offer, self.resume_seq).verify_slice(mac).is_ok()
    }
}

impl Reply {
    /// The reply's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(super::MAGIC);
        out.push(VERSION);
        match self {
            Self::Accepted(accept) => {
                out.push(ACCEPTED);
                push_message(&mut out, &accept.note);
                let shm = accept.shm.as_ref().filter(|o| o.name.len() <= usize::from(u8::MAX));
                out.push(
                    u8::from(accept.replay)
                        | (u8::from(accept.mac.is_some()) << 1)
                        | if shm.is_some() { REPLY_SHM } else { 0 }
                        | if accept.steps.is_some() { REPLY_STEPS } else { 0 }
                        | if accept.codecs.is_some() { REPLY_CODECS } else { 0 }
                        | if accept.durable { REPLY_DURABLE } else { 0 }
                        | if accept.params { REPLY_PARAMS } else { 0 }
                        | if accept.versions.is_some() { REPLY_VERSIONS } else { 0 },
                );
                out.extend_from_slice(&accept.resume_seq.to_le_bytes());
                out.extend_from_slice(&accept.heartbeat_ms.to_le_bytes());
                if let Some(mac) = &accept.mac {
                    out.extend_from_slice(mac);
                }
                if let Some(offer) = shm {
                    out.push(offer.name.len() as u8);
                    out.extend_from_slice(&offer.name);
                    out.extend_from_slice(&offer.nonce);
                }
                if let Some(max_rows) = accept.steps {
                    out.extend_from_slice(&max_rows.to_le_bytes());
                }
                if let Some(codecs) = &accept.codecs {
                    out.extend_from_slice(&(codecs.len() as u32).to_le_bytes());
                    for codec in codecs {
                        let (id, level) = codec_bytes(*codec);
                        out.push(id);
                        out.push(level);
                    }
                }
                if let Some(admit) = accept.versions {
                    out.extend_from_slice(&admit.to_le_bytes());
                }
            }
            Self::Refused(why, message) => {
                out.push(*why as u8);
                push_message(&mut out, message);
            }
        }
        out
    }

    /// Parses a reply from the bytes received so far: `Ok(None)` if incomplete, else the
    /// reply and its length.
    ///
    /// # Errors
    /// [`EchoError::Protocol`] if the bytes are not a reply.
    pub fn parse(received: &[u8]) -> Result<Option<(Self, usize)>, EchoError> {
        super::check_magic(received)?;
        let mut reader = Cursor(received);
        let parsed = (|| {
            reader.take(4)?;
            let version = reader.u8()?;
            if version != VERSION {
                return Err(EchoError::Protocol(format!("reply version {version}")));
            }
            let status = reader.u8()?;
            let message = read_message(&mut reader)?;
            if status != ACCEPTED {
                let why = Refusal::from_status(status).ok_or_else(|| {
                    EchoError::Protocol(format!("unknown reply status {status}: {message}"))
                })?;
                return Ok(Self::Refused(why, message));
            }
            let flags = reader.u8()?;
            let resume_seq = reader.u64()?;
            let heartbeat_ms = reader.u32()?;
            let mac = if flags & 2 != 0 { Some(reader.array::<MAC_LEN>()?) } else { None };
            let shm = if flags & REPLY_SHM != 0 {
                let len = usize::from(reader.u8()?);
                let name = reader.take(len)?.to_vec();
                Some(ShmOffer { name, nonce: reader.array()? })
            } else {
                None
            };
            let steps = if flags & REPLY_STEPS != 0 { Some(reader.u32()?) } else { None };
            let codecs = if flags & REPLY_CODECS != 0 {
                let n = reader.u32()?;
                if n > super::MAX_ARRAYS {
                    return Err(EchoError::Protocol(format!("reply names codecs of {n} leaves")));
                }
                let codecs = (0..n)
                    .map(|_| {
                        let (id, level) = (reader.u8()?, reader.u8()?);
                        codec_from_bytes(id, level)
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Some(codecs)
            } else {
                None
            };
            let versions = if flags & REPLY_VERSIONS != 0 { Some(reader.u64()?) } else { None };
            Ok(Self::Accepted(Accept {
                replay: flags & 1 != 0,
                resume_seq,
                heartbeat_ms,
                mac,
                shm,
                note: message,
                steps,
                codecs,
                durable: flags & REPLY_DURABLE != 0,
                params: flags & REPLY_PARAMS != 0,
                versions,
            }))
        })();
        match parsed {
            Ok(reply) => Ok(Some((reply, received.len() - reader.0.len()))),
            Err(EchoError::Io(_)) => Ok(None),
            Err(err) => Err(err),
        }
    }
}

/// A leaf's codec as the reply carries it: its id (0 raw, 1 zstd, 2 lz4) and level (i8).
fn codec_bytes(codec: Option<Codec>) -> (u8, u8) {
    match codec {
        None => (0, 0),
        Some(Codec::Zstd { level }) => (1, i8::try_from(level).unwrap_or(1) as u8),
        Some(Codec::Lz4) => (2, 0),
    }
}

fn codec_from_bytes(id: u8, level: u8) -> Result<Option<Codec>, EchoError> {
    let codec = match id {
        0 => return Ok(None),
        1 => Codec::Zstd { level: i32::from(level as i8) },
        2 => Codec::Lz4,
        other => return Err(EchoError::Protocol(format!("unknown codec {other} in the reply"))),
    };
    codec.validate().map_err(|e| EchoError::Protocol(format!("the reply's codec: {e}")))?;
    Ok(Some(codec))
}

/// An error frame's bytes: [`ERROR`], then the message.
pub fn encode_error(message: &str) -> Vec<u8> {
    let mut out = vec![ERROR];
    push_message(&mut out, message);
    out
}

/// Parses the message of an error frame (the bytes after [`ERROR`]): `Ok(None)` if incomplete.
///
/// # Errors
/// [`EchoError::Protocol`] for an oversized message.
pub fn parse_error(received: &[u8]) -> Result<Option<(String, usize)>, EchoError> {
    let mut reader = Cursor(received);
    match read_message(&mut reader) {
        Ok(message) => Ok(Some((message, received.len() - reader.0.len()))),
        Err(EchoError::Io(_)) => Ok(None),
        Err(err) => Err(err),
    }
}

fn push_message(out: &mut Vec<u8>, message: &str) {
    let mut end = message.len().min(MAX_MESSAGE as usize);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u32).to_le_bytes());
    out.extend_from_slice(&message.as_bytes()[..end]);
}

fn read_message(reader: &mut Cursor<'_>) -> Result<String, EchoError> {
    let len = reader.u32()?;
    if len > MAX_MESSAGE {
        return Err(EchoError::Protocol(format!("message of {len} bytes")));
    }
    Ok(String::from_utf8_lossy(reader.take(len as usize)?).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_headers_round_trip_and_bad_ones_are_refused() {
        let metas = [
            FrameMeta::default(),
            FrameMeta { priority: Some(2.5), ..FrameMeta::default() },
            FrameMeta { row: 7, end: EpisodeEnd::Terminated, priority: None },
            FrameMeta { row: 0, end: EpisodeEnd::Truncated, priority: Some(0.0) },
            FrameMeta { row: u32::MAX, end: EpisodeEnd::No, priority: Some(1e10) },
        ];
        let lens = [1, 9, 6, 14, 14];
        for (meta, len) in metas.iter().zip(lens) {
            let (header, n) = meta.encode();
            assert_eq!(n, len, "{meta:?}");
            assert_eq!(FrameMeta::rest_len(header[0]), Some(n - 1));
            assert_eq!(&FrameMeta::decode(header[0], &header[1..n]).unwrap(), meta);
            let mut frame = header[..n].to_vec();
            frame.extend_from_slice(b"payload");
            assert_eq!(FrameMeta::split(&frame).unwrap(), (*meta, &b"payload"[..]));
        }
        let bad_end = FrameMeta::decode(STEP, &[0, 0, 0, 0, 3]).unwrap_err().to_string();
        assert!(bad_end.contains("episode flag is 0, 1 or 2"), "{bad_end}");
        assert!(FrameMeta::decode(0x14, &[]).unwrap_err().to_string().contains("unknown frame"));
        assert!(FrameMeta::decode(STEP, &[0; 4]).is_err(), "short header");
        assert!(FrameMeta::split(&[STEP_PRIORITY, 0, 0]).is_err(), "truncated frame");
        assert!(FrameMeta::split(&[]).is_err());
    }

    fn layout() -> Layout {
        Layout(vec![
            LeafType {
                name: "['obs']".into(),
                dtype: DType { order: b'<', kind: b'f', size: 4 },
                shape: vec![3],
            },
            LeafType {
                name: "['id']".into(),
                dtype: DType { order: b'<', kind: b'i', size: 8 },
                shape: vec![],
            },
        ])
    }

    fn hello(mac: bool) -> (Offer, Vec<u8>) {
        let offer = Offer::new(Mode::Token).unwrap();
        let hello = Hello {
            session: [7; 16],
            first_seq: 42,
            heartbeat_ms: 10_000,
            client_nonce: [9; 16],
            layout: layout(),
            mac: None,
            shm: mac,
            notices: !mac,
            codecs: mac,
            durable: mac,
            params: !mac,
            versions: mac,
        };
        let token: &[u8] = b"secret";
        let bytes = hello.encode(&offer, mac.then_some(token)).unwrap();
        (offer, bytes)
    }

    #[test]
    fn a_persisted_notice_round_trips_and_is_incomplete_until_its_last_byte() {
        for seq in [0, 1, 0x0102_0304_0506_0708, u64::MAX] {
            let bytes = encode_persisted(seq);
            assert_eq!(parse_persisted(&bytes), Some(seq));
            let mut longer = bytes.to_vec();
            longer.push(ACK);
            assert_eq!(parse_persisted(&longer), Some(seq), "what follows is not its");
            for cut in 0..PERSISTED_LEN {
                assert_eq!(parse_persisted(&bytes[..cut]), None, "cut at {cut}");
            }
        }
        assert_eq!(parse_persisted(&[ACK; PERSISTED_LEN]), None, "not a notice");
    }

    #[test]
    fn an_accept_says_whether_it_sends_persisted_notices() {
        for durable in [false, true] {
            let accept = Accept { durable, ..Accept::new(true, 5, 1000, None) };
            let bytes = Reply::Accepted(accept.clone()).encode();
            let (parsed, len) = Reply::parse(&bytes).unwrap().unwrap();
            assert_eq!((parsed, len), (Reply::Accepted(accept), bytes.len()));
        }
    }

    #[test]
    fn an_accept_carries_the_admission_bound_after_the_codecs() {
        for versions in [None, Some(0), Some(3), Some(u64::MAX)] {
            let accept = Accept {
                versions,
                codecs: Some(vec![None, Some(Codec::Lz4)]),
                ..Accept::new(false, 9, 0, None)
            };
            let bytes = Reply::Accepted(accept.clone()).encode();
            let (parsed, len) = Reply::parse(&bytes).unwrap().unwrap();
            assert_eq!((parsed, len), (Reply::Accepted(accept), bytes.len()));
            for cut in 0..bytes.len() {
                assert_eq!(Reply::parse(&bytes[..cut]).unwrap(), None, "cut at {cut}");
            }
        }
    }

    #[test]
    fn an_offer_round_trips_and_holds_no_ack_byte() {
        for mode in [Mode::Open, Mode::Token] {
            let offer = Offer::new(mode).unwrap();
            let bytes = offer.encode();
            assert!(!bytes.contains(&ACK), "{bytes:?}");
            assert_eq!(Offer::parse(&bytes).unwrap(), Some(offer));
            for cut in 0..OFFER_LEN {
                assert_eq!(Offer::parse(&bytes[..cut]).unwrap(), None, "cut at {cut}");
            }
        }
        assert!(Offer::parse(b"ECHO\x01").is_err());
        assert!(Offer::parse(b"ECHO\x02x").is_err());
    }

    #[test]
    fn a_hello_round_trips_signed_and_verifies_only_with_the_token() {
        let (offer, bytes) = hello(true);
        let max = max_hello_body(&layout());
        for cut in 0..bytes.len() {
            assert!(
                matches!(parse_opening(&bytes[..cut], &offer, max).unwrap(), Opening::NeedMore),
                "cut at {cut}"
            );
        }
        let Opening::Hello(parsed, body, len) = parse_opening(&bytes, &offer, max).unwrap() else {
            panic!("not a hello")
        };
        assert_eq!(len, bytes.len());
        assert_eq!((parsed.first_seq, parsed.session, &parsed.layout), (42, [7; 16], &layout()));
        assert!(parsed.shm, "the shared-memory flag round-trips");
        assert!(parsed.durable, "so does the durable flag");
        assert!(!parsed.params, "and the parameters flag (off)");
        assert!(!parsed.notices, "so does the closing-notices flag (off)");
        assert!(parsed.verify(&offer, b"secret", &body));
        assert!(!parsed.verify(&offer, b"Secret", &body));
        let other = Offer::new(Mode::Token).unwrap();
        assert!(!parsed.verify(&other, b"secret", &body), "a replayed hello must not verify");
        let (offer, bytes) = hello(false);
        let Opening::Hello(parsed, body, _) = parse_opening(&bytes, &offer, max).unwrap() else {
            panic!("not a hello")
        };
        assert!(parsed.mac.is_none() && !parsed.verify(&offer, b"secret", &body));
        assert!(parsed.notices && !parsed.shm, "each flag on its own");
        assert!(parsed.params && !parsed.durable);
    }

    #[test]
    fn bytes_that_do_not_start_with_the_nonce_are_v1_data() {
        let offer = Offer::new(Mode::Open).unwrap();
        let mut data = offer.nonce.to_vec();
        data[3] ^= 0x20;
        assert!(matches!(parse_opening(&data, &offer, 1 << 20).unwrap(), Opening::V1));
        assert!(matches!(parse_opening(&[0, 0, 0], &offer, 1 << 20).unwrap(), Opening::V1));
        assert!(matches!(parse_opening(&offer.nonce[..5], &offer, 1).unwrap(), Opening::NeedMore));
    }

    #[test]
    fn an_oversized_hello_is_refused_before_it_is_read() {
        let (offer, bytes) = hello(false);
        let err = parse_opening(&bytes[..HELLO_HEAD], &offer, 10).unwrap_err();
        assert!(matches!(err, EchoError::Protocol(m) if m.contains("more than")));
    }

    #[test]
    fn replies_round_trip_and_the_server_proof_binds_the_nonces() {
        let (offer, bytes) = hello(true);
        let Opening::Hello(parsed, ..) =
            parse_opening(&bytes, &offer, max_hello_body(&layout())).unwrap()
        else {
            panic!("not a hello")
        };
        let accept = Accept::new(true, 40, 5000, Some((b"secret", &parsed, &offer)));
        let bytes = Reply::Accepted(accept.clone()).encode();
        for cut in 0..bytes.len() {
            assert_eq!(Reply::parse(&bytes[..cut]).unwrap(), None, "cut at {cut}");
        }
        let (reply, len) = Reply::parse(&bytes).unwrap().unwrap();
        assert_eq!((reply, len), (Reply::Accepted(accept.clone()), bytes.len()));
        assert!(accept.verify(b"secret", &parsed, &offer));
        assert!(!accept.verify(b"other", &parsed, &offer));
        let mut offered = accept.clone();
        offered.shm = Some(ShmOffer { name: b"echo-shm-00ff".to_vec(), nonce: [3; 16] });
        offered.note = String::new();
        let bytes = Reply::Accepted(offered.clone()).encode();
        for cut in 0..bytes.len() {
            assert_eq!(Reply::parse(&bytes[..cut]).unwrap(), None, "cut at {cut}");
        }
        assert_eq!(Reply::parse(&bytes).unwrap().unwrap(), (Reply::Accepted(offered), bytes.len()));
        let mut declined = accept;
        declined.note = "the client is on another host".into();
        let bytes = Reply::Accepted(declined.clone()).encode();
        assert_eq!(Reply::parse(&bytes).unwrap().unwrap().0, Reply::Accepted(declined));
        let refused = Reply::Refused(Refusal::Layout, "leaf x".into());
        assert_eq!(Reply::parse(&refused.encode()).unwrap().unwrap().0, refused);
    }

    #[test]
    fn layout_mismatches_name_the_leaf_and_both_sides() {
        let mut client = layout();
        client.0[0].dtype = DType { order: b'<', kind: b'i', size: 4 };
        let msg = layout().mismatch(&client).unwrap();
        assert!(
            msg.contains("['obs']") && msg.contains("float32") && msg.contains("int32"),
            "{msg}"
        );
        let mut client = layout();
        client.0[1].name = "['ident']".into();
        let msg = layout().mismatch(&client).unwrap();
        assert!(msg.contains("['id']") && msg.contains("['ident']"), "{msg}");
        assert_eq!(layout().mismatch(&layout()), None);
    }

    #[test]
    fn error_frames_round_trip() {
        let bytes = encode_error("bad priority");
        assert_eq!(bytes[0], ERROR);
        assert_eq!(
            parse_error(&bytes[1..]).unwrap(),
            Some(("bad priority".into(), bytes.len() - 1))
        );
        assert_eq!(parse_error(&bytes[1..4]).unwrap(), None);
    }
}
