//! A connection's samples: v1's bare payloads, a v2 session's attach or resume (and its
//! shared-memory offer, served by [`crate::transport::shm`]), and v2 sample frames (plain,
//! prioritised, steps, compressed), whose fields pass the checks of [`super::checks`].

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::Notify;

use super::checks::{check_frame, max_rows};
use super::link::{invalid, Link, Notices, Pooled, Versions};
use super::session::LOG_TARGET;
use super::session::{Session, Shared, TAKEOVER_GRACE};
use crate::codec::LeafCodecs;
use crate::ingress::{BudgetHold, Connection, Packed, StepMark, TransportEvent};
use crate::params::{ChunkBytes, Params};
use crate::transport::shm;
use crate::transport::shm::ShmEnd;
use crate::transport::wire::params;
use crate::transport::wire::v2::{self, Beat, FrameMeta, Hello, Offer, Refusal, Reply};

pub(super) async fn serve_v1(
    link: &mut Link<'_>,
    conn: &Arc<Connection>,
    space: &Notify,
) -> io::Result<()> {
    let payload_size = conn.payload_size();
    loop {
        if link.read_in_place(conn).await? {
            link.acks += 1;
            link.activity.complete();
            continue;
        }
        let mut buf = link.buffer(conn, space).await?;
        if !link.fill(buf.bytes(), payload_size).await? {
            return Ok(());
        }
        link.push(conn, space, buf, None, None, StepMark::default()).await?;
        link.acks += 1;
        link.activity.complete();
    }
}

/// Ends a session's service when its task ends however it ends: the session waits for its
/// client to come back (or is forgotten after a goodbye).
struct Serving<'a> {
    pub(super) shared: &'a Shared,
    pub(super) key: [u8; 16],
    pub(super) session: Arc<Session>,
    pub(super) id: u64,
    pub(super) goodbye: bool,
}

impl Drop for Serving<'_> {
    fn drop(&mut self) {
        let mut serving = self.session.serving.lock();
        if *serving == Some(self.id) {
            *serving = None;
            if self.goodbye {
                self.shared.sessions.0.lock().remove(&self.key);
            } else {
                *self.session.detached_at.lock() = Some(Instant::now());
                self.session.conn.detach();
            }
        }
    }
}

pub(super) async fn serve_v2(
    link: &mut Link<'_>,
    peer: SocketAddr,
    shared: &Shared,
    id: u64,
    offer: &Offer,
    hello: &Hello,
    body: &[u8],
) -> io::Result<()> {
    let ingress = &shared.ingress;
    if let Some(token) = &shared.token {
        let why = if hello.mac.is_none() {
            Some("this echo server requires a token: pass token= or set ECHO_TOKEN")
        } else if !hello.verify(offer, token, body) {
            Some("wrong token: the client's proof does not match this server's token")
        } else {
            None
        };
        if let Some(why) = why {
            ingress.note(TransportEvent::RefusedAuth);
            link.refuse(Refusal::Auth, why).await;
            return Err(invalid(format!("refused: {why}")));
        }
    }
    // A server that keeps policy versions compares the client's sample leaves plus the
    // version leaf it appends; a client that sends none cannot feed it.
    let mismatch = match (&shared.versions, hello.versions) {
        (Some(_), true) => shared.layout.mismatch(&hello.layout.with_policy_version()),
        (Some(_), false) => Some(
            "the learner keeps the policy version of every sample (Server(max_staleness=...) \
             or policy_versions=True), and this client does not send them: upgrade echo on \
             the worker"
                .to_owned(),
        ),
        (None, _) => shared.layout.mismatch(&hello.layout),
    };
    if let Some(why) = mismatch {
        ingress.note(TransportEvent::RefusedLayout);
        let message =
            format!("the server at {} stores samples of another layout: {why}", link.local());
        link.refuse(Refusal::Layout, &message).await;
        return Err(invalid(format!("refused: {why}")));
    }
    // The session: created, or taken over from the connection that served it before.
    let (session, existed) = {
        let mut sessions = shared.sessions.0.lock();
        match sessions.get(&hello.session) {
            Some(session) => (Arc::clone(session), true),
            None => {
                let session = Arc::new(Session::new(ingress, hello.first_seq, hello.durable));
                sessions.insert(hello.session, Arc::clone(&session));
                (session, false)
            }
        }
    };
    // A resume claims only what the session acknowledged: checked before the connection
    // that serves the session now is ended (so a refused claim costs it nothing), and again
    // once this task owns the session.
    if hello.durable {
        // ORDERING: Relaxed — a flag read by checkpoints; set before this session's first
        // sample from a durable client is queued, which the checkpoint's capture orders.
        session.durable.store(true, Relaxed);
    }
    let durable = session.durable.load(Relaxed);
    if existed {
        if let Some(why) = session.refuse_resume(hello.first_seq, durable) {
            return Err(refuse_resume(link, ingress, &why).await);
        }
    }
    let previous = session.serving.lock().take();
    if let Some(previous) = previous {
        if let Some((_, task)) = shared.served.lock().get(&previous) {
            // Its socket is half dead (the client already reconnected): end it. Its guard
            // releases `owner` once it stops at an await point.
            task.abort();
        }
    }
    let Ok(_owner) =
        tokio::time::timeout(TAKEOVER_GRACE, Arc::clone(&session.owner).lock_owned()).await
    else {
        return Err(invalid("the session's previous connection did not end in time".into()));
    };
    if existed {
        if let Some(why) = session.refuse_resume(hello.first_seq, durable) {
            // The connection that served the session was ended above: the session waits for
            // its client as after any disconnection.
            {
                let serving = session.serving.lock();
                if serving.is_none() {
                    *session.detached_at.lock() = Some(Instant::now());
                    session.conn.detach();
                }
            }
            return Err(refuse_resume(link, ingress, &why).await);
        }
    }
    *session.serving.lock() = Some(id);
    *session.detached_at.lock() = None;
    let mut serving =
        Serving { shared, key: hello.session, session: Arc::clone(&session), id, goodbye: false };
    // ORDERING: Relaxed — `next_seq`, `floor` and `handed` are written only under `owner`,
    // which we hold; the mutex orders these accesses after the previous holder's writes.
    session.floor.store(session.floor(), Relaxed);
    let queued = session.next_seq.load(Relaxed);
    // `first_seq <= queued` (checked above) for a resume; a new session starts at `first_seq`.
    // A durable session resumes where it stands even behind `first_seq`: a restored server's
    // stands where its checkpoint does, and its client resends what it kept from there.
    let resume_seq = if durable { queued } else { queued.max(hello.first_seq) };
    // ORDERING: Relaxed — as above: written under `owner`, which orders them for its next
    // holder.
    session.next_seq.store(resume_seq, Relaxed);
    // ORDERING: Relaxed — as above.
    session.handed.store(resume_seq, Relaxed);
    ingress.note(TransportEvent::V2);
    if existed {
        let deduplicated = resume_seq.saturating_sub(hello.first_seq);
        ingress.note(TransportEvent::Resumed { deduplicated });
    }
    let own_ms = shared.heartbeat.map_or(0, |d| u32::try_from(d.as_millis()).unwrap_or(u32::MAX));
    let signed = shared.token.as_deref().map(|token| (token, hello, offer));
    let mut accept =
        v2::Accept::new(ingress.backend().has_priorities(), resume_seq, own_ms, signed);
    accept.steps = max_rows(ingress.backend());
    let mut channel = None;
    accept.durable = hello.durable;
    // Parameter fetches to a client that asks, when the server has a parameter channel.
    let served_params = shared.params.clone().filter(|_| hello.params);
    accept.params = served_params.is_some();
    accept.versions = shared.versions.as_ref().filter(|_| hello.versions).map(|versions| {
        match (versions.admission(), versions.max_staleness()) {
            (crate::versions::Admission::Block, Some(k)) => k,
            _ => u64::MAX,
        }
    });
    if hello.shm {
        match shm::server::prepare(shared, peer, link) {
            Ok(prepared) => {
                accept.shm = Some(prepared.offer.clone());
                channel = Some(prepared);
            }
            Err(why) => {
                log::debug!(target: LOG_TARGET, "{peer}: no shared memory: {why}");
                ingress.note(TransportEvent::ShmFallback);
                accept.note = why;
            }
        }
    }
    // Compressed frames over TCP to a client that takes them, unless it is offered shared
    // memory, which copies raw (should it decline the channel, its frames come raw too). A
    // worker on another host asks for shared memory too (by default), is not offered it, and
    // compresses.
    let codecs = shared.codecs.as_ref().filter(|_| hello.codecs && accept.shm.is_none());
    accept.codecs = codecs.map(|c| c.as_slice().to_vec());
    link.write(&Reply::Accepted(accept).encode()).await?;
    link.beat = Beat::new(shared.heartbeat, hello.heartbeat_ms);
    if let Some(params) = &served_params {
        let mut latest = params.subscribe();
        // Tells the client the latest version at once (if there is one).
        latest.mark_changed();
        link.versions = Some(Versions { latest, told: 0 });
    }
    if hello.durable {
        let mut completed = shared.persisted.subscribe();
        // Tells the client where the session is persisted at once (a restored session is
        // persisted up to where it resumes).
        completed.mark_changed();
        link.notices = Some(Notices { completed, session: Arc::clone(&session), told: 0 });
    }
    log::debug!(target: LOG_TARGET, "{peer}: v2 session resumed at sample {resume_seq} (resumed: {existed})");
    if let Some(prepared) = channel {
        let params = served_params.as_deref();
        match shm::server::serve(link, shared, &session, prepared, params).await? {
            ShmEnd::Closed => return Ok(()),
            ShmEnd::Goodbye => {
                serving.goodbye = true;
                return Ok(());
            }
            ShmEnd::Declined => {
                log::debug!(target: LOG_TARGET, "{peer}: the client declined shared memory; frames over TCP");
                ingress.note(TransportEvent::ShmFallback);
            }
        }
    }
    let params = served_params.as_deref();
    serve_frames(link, shared, &session, &mut serving, codecs.map(|c| &**c), params).await
}

/// Refuses a resume that claims what its session did not acknowledge (counted as a refused
/// handshake), and the error that ends the connection.
async fn refuse_resume(
    link: &mut Link<'_>,
    ingress: &crate::ingress::Ingress,
    why: &str,
) -> io::Error {
    ingress.note(TransportEvent::RefusedProtocol);
    link.refuse(Refusal::Protocol, why).await;
    invalid(format!("refused: {why}"))
}

/// The v2 frame loop: samples (with or without a priority), heartbeats and the goodbye.
async fn serve_frames(
    link: &mut Link<'_>,
    shared: &Shared,
    session: &Session,
    serving: &mut Serving<'_>,
    codecs: Option<&LeafCodecs>,
    params: Option<&Params>,
) -> io::Result<()> {
    let ingress = &shared.ingress;
    let (conn, space) = (&session.conn, &*session.space);
    let payload_size = conn.payload_size();
    let stream_cost = ingress.backend().stream_cost();
    // A compressed frame's body, read whole before it is decompressed into a buffer.
    let mut body = Body::new(conn);
    loop {
        let Some(kind) = link.next_byte().await? else { return Ok(()) };
        let len = match kind {
            v2::HEARTBEAT => continue,
            v2::BYE => {
                serving.goodbye = true;
                return Ok(());
            }
            params::FETCH if params.is_some() => {
                serve_fetch(link, params.expect("matched")).await?;
                continue;
            }
            other => match FrameMeta::rest_len(other & !packed_bit(other)) {
                Some(len) => len,
                None => return Err(link.fail(&format!("unknown frame type {other:#04x}")).await),
            },
        };
        let packed = packed_bit(kind) != 0;
        let kind = kind & !packed_bit(kind);
        let mut raw = [0u8; FrameMeta::MAX_HEADER];
        if len > 0 && !link.fill(&mut raw, len).await? {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed mid-frame"));
        }
        let meta = match check_frame(ingress.backend(), kind, &raw[..len]) {
            Ok(meta) => meta,
            Err(why) => return Err(link.fail(&why).await),
        };
        let (priority, mark) = (meta.priority, StepMark { row: meta.row, end: meta.end });
        if stream_cost > 0 {
            link.hold_stream(conn, space, meta.row).await?;
        }
        if packed {
            let Some(codecs) = codecs else {
                let why = "a compressed frame, but this connection agreed on no codecs";
                return Err(link.fail(why).await);
            };
            let keep = shared.keep_packed;
            let (buf, kept) = match read_packed(link, conn, space, codecs, keep, &mut body).await? {
                Ok(read) => read,
                Err(why) => return Err(link.fail(&why).await),
            };
            ingress.note_compressed(body.bytes.len());
            link.push(conn, space, buf, kept, priority, mark).await?;
            // ORDERING: Relaxed — as below.
            session.next_seq.fetch_add(1, Relaxed);
            link.acks += 1;
            link.activity.complete();
            continue;
        }
        if priority.is_none() && !meta.is_step() && link.read_in_place(conn).await? {
            // ORDERING: Relaxed — as below.
            session.next_seq.fetch_add(1, Relaxed);
            link.acks += 1;
            link.activity.complete();
            continue;
        }
        let mut buf = link.buffer(conn, space).await?;
        if !link.fill(buf.bytes(), payload_size).await? {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed mid-frame"));
        }
        link.push(conn, space, buf, None, priority, mark).await?;
        // ORDERING: Relaxed — see above; pushed and counted with no await in between, so an
        // abort cannot separate them.
        session.next_seq.fetch_add(1, Relaxed);
        link.acks += 1;
        link.activity.complete();
    }
}

/// Answers one parameter fetch ([`params::FETCH`], its kind byte read) with one chunk of the
/// version it asks for, or the news that the version is gone (see [`params`]). The chunk is
/// copied out of the store into a buffer lent with a turn ([`Params::chunk_turn`]: at most a
/// few chunks at once, in the order asked, outside the samples' byte budget), then written; a
/// worker slow to read it gives its turn up after [`CHUNK_TURN`], keeping the buffer until
/// its bytes are written.
pub(crate) async fn serve_fetch(link: &mut Link<'_>, published: &Params) -> io::Result<()> {
    let mut raw = [0u8; params::FETCH_LEN - 1];
    if !link.fill(&mut raw, params::FETCH_LEN - 1).await? {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed mid-frame"));
    }
    if raw[..8] == params::DESCRIPTION.to_le_bytes() {
        return serve_description(link, &raw, published).await;
    }
    let Some(store) = published.store() else {
        return link.write(&params::Chunk::raw(0, 0, 0, 0).encode()).await;
    };
    let size = store.size() as u64;
    let fetch = match params::Fetch::decode(&raw, size) {
        Ok(fetch) => fetch,
        Err(why) => return Err(link.fail(&why.to_string()).await),
    };
    let mut turn = published.chunk_turn().await;
    let version = if fetch.version == 0 { store.latest() } else { fetch.version };
    // `decode` checked `offset + len <= size`.
    let offset = usize::try_from(fetch.offset).expect("within the parameters' size");
    let header = match store.read_chunk(version, offset, fetch.len as usize, &mut turn.bytes) {
        Ok(bytes) => params::Chunk {
            packed: match bytes {
                ChunkBytes::Raw => None,
                ChunkBytes::Packed(codec) => {
                    Some((codec, u32::try_from(turn.bytes.len()).expect("below a chunk")))
                }
            },
            ..params::Chunk::raw(version, size, fetch.offset, fetch.len)
        },
        Err(gone) => params::Chunk::raw(gone.latest, size, 0, 0),
    };
    let wire_len = if header.len > 0 { header.wire_len() } else { 0 };
    // Counted before it is written: a worker that has the chunk must find it counted
    // (a write that fails ends the connection, and its chunk counts as served).
    if wire_len > 0 {
        published.note_served(wire_len);
    }
    // Out of the turn while it is written (the turn may be passed meanwhile); back in it
    // after, for the next chunk (a write that fails drops it).
    let bytes = std::mem::take(&mut turn.bytes);
    {
        let write = async {
            link.write(&header.encode()).await?;
            link.write(&bytes[..wire_len]).await
        };
        tokio::pin!(write);
        tokio::select! {
            written = &mut write => written?,
            () = tokio::time::sleep(CHUNK_TURN) => {
                turn.pass();
                write.await?;
            }
        }
    }
    turn.bytes = bytes;
    Ok(())
}

/// How long one chunk's write may keep its turn ([`Params::chunk_turn`]) before the next
/// worker's chunk is served beside it: a megabyte in 50 ms is 20 MB/s.
const CHUNK_TURN: std::time::Duration = std::time::Duration::from_millis(50);

/// Answers a fetch of the parameters' description ([`params::DESCRIPTION`]; `raw`, the
/// fetch after its kind byte): bytes of it, or its size alone to a probe.
async fn serve_description(link: &mut Link<'_>, raw: &[u8], published: &Params) -> io::Result<()> {
    let description = published.description();
    let size = description.len() as u64;
    let fetch = match params::Fetch::decode(raw, size) {
        Ok(fetch) => fetch,
        Err(why) => return Err(link.fail(&why.to_string()).await),
    };
    let header = params::Chunk::raw(params::DESCRIPTION, size, fetch.offset, fetch.len);
    link.write(&header.encode()).await?;
    // `decode` checked `offset + len <= size`.
    let start = usize::try_from(fetch.offset).expect("within the description");
    link.write(&description[start..start + fetch.len as usize]).await
}

/// [`v2::PACKED`] if `kind` is a compressed sample frame (0x14..=0x17), else 0.
fn packed_bit(kind: u8) -> u8 {
    if (v2::SAMPLE | v2::PACKED..=v2::STEP_PRIORITY | v2::PACKED).contains(&kind) {
        v2::PACKED
    } else {
        0
    }
}

/// How much a compressed frame's body buffer grows at a time as its bytes arrive: a peer
/// that declares a large body and sends a few bytes makes the learner hold at most this
/// much for it (counted in the byte budget like everything else it holds).
const BODY_STEP: usize = 64 * 1024;

/// A connection's buffer for compressed frame bodies, reused frame to frame, whose capacity
/// is held in the ingress's byte budget (`max_buffered_bytes`) for as long as it exists.
pub(crate) struct Body {
    bytes: Vec<u8>,
    hold: BudgetHold,
}

impl Body {
    pub(crate) fn new(conn: &Connection) -> Self {
        Self { bytes: Vec::new(), hold: conn.hold() }
    }
}

/// Reads a compressed frame's `body_len` and body (into `body`, reused) and decompresses it
/// into a pooled buffer. Returns the buffer and, with `keep`, the packed bytes (what a table
/// that stores the leaves compressed keeps; copied out only then, and held in the byte
/// budget until inserted), or, as `Err` inside, why the frame is refused: a length above what
/// these codecs can produce or the byte budget can hold, or a body that does not decompress
/// to exactly the sample. The body grows [`BODY_STEP`] at a time as its bytes arrive, each
/// step taken from the byte budget first (waiting while it is spent), so a peer makes the
/// learner hold only what it sent, and all of it within `max_buffered_bytes`.
async fn read_packed<'c>(
    link: &mut Link<'_>,
    conn: &'c Arc<Connection>,
    space: &Notify,
    codecs: &LeafCodecs,
    keep: bool,
    body: &mut Body,
) -> io::Result<Result<(Pooled<'c>, Option<Packed>), String>> {
    let mut len = [0u8; 4];
    if !link.fill(&mut len, 4).await? {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed mid-frame"));
    }
    let len = u32::from_le_bytes(len) as usize;
    let max = codecs.max_body();
    if len > max {
        return Ok(Err(format!(
            "a compressed frame of {len} bytes: these leaves compress to at most {max}"
        )));
    }
    // The body, the decompressed sample and (kept) the packed leaves, held at once.
    let (limit, copies) = (body.hold.limit(), if keep { 2 } else { 1 });
    if len.saturating_mul(copies).saturating_add(conn.payload_size()) > limit {
        return Ok(Err(format!(
            "a compressed frame of {len} bytes: with its sample ({} bytes) more than the \
             server's max_buffered_bytes ({limit}) can hold",
            conn.payload_size()
        )));
    }
    body.bytes.clear();
    while body.bytes.len() < len {
        let filled = body.bytes.len();
        let upto = len.min(filled + BODY_STEP);
        if upto > body.hold.bytes() {
            let more = upto - body.hold.bytes();
            link.grow_hold(conn, space, &mut body.hold, more).await?;
            body.bytes.reserve_exact(upto - filled);
        }
        body.bytes.resize(upto, 0);
        if !link.fill(&mut body.bytes[filled..], upto - filled).await? {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed mid-frame"));
        }
    }
    let mut buf = link.buffer(conn, space).await?;
    let at = match codecs.unpack_body(&body.bytes, buf.bytes()) {
        Ok(at) => at,
        Err(why) => return Ok(Err(format!("a compressed frame that does not decode: {why}"))),
    };
    if !keep {
        return Ok(Ok((buf, None)));
    }
    let kept = &body.bytes[at..];
    let mut hold = conn.hold();
    link.grow_hold(conn, space, &mut hold, kept.len()).await?;
    Ok(Ok((buf, Some(Packed::new(Box::from(kept), hold)))))
}
