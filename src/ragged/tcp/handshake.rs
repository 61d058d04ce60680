//! A worker's handshake with a ragged server: wire v2's offer, hello and reply (the token,
//! the layout, policy versions), the worker's session taken over, and the notices its
//! connection takes; then the same-host pipe offered.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{shm, Owned, Session, Shared, HELLO_TIMEOUT, WRITE_TIMEOUT};
use crate::error::EchoError;
use crate::ragged::table::RaggedSampler;
use crate::transport::wire::v2::{self, Accept, Mode, Offer, Opening, Refusal, Reply};
use crate::versions::Admission;

/// The names of the ragged leaves, for messages.
fn ragged_names(shared: &Shared) -> String {
    let names: Vec<&str> =
        shared.table.spec().columns().iter().filter(|c| c.is_ragged()).map(|c| c.name()).collect();
    names.join(", ")
}

/// What a completed handshake leaves: the hello, the bytes after it, the pipe offered, and
/// the worker's session, owned.
pub(super) type Handshake = (v2::Hello, Vec<u8>, Option<shm::Offered>, Owned);

/// Takes over the session `hello` names for connection `id` (a new one starts at the
/// worker's `first_seq`: what an earlier server acknowledged is not asked for again): a
/// connection of the same worker that still owns it stores nothing more and is shut down.
/// Returns the hold and the samples stored, where the worker resumes. Sessions no
/// connection has owned for `session_timeout` are forgotten first, and the idle ones
/// beyond four per connection allowed, oldest first.
fn take_session(shared: &Shared, hello: &v2::Hello, id: u64) -> (Owned, u64) {
    let session = {
        let mut sessions = shared.sessions.lock();
        let idle = |s: &Session| *s.idle_since.lock();
        sessions.retain(|_, s| idle(s).is_none_or(|t| t.elapsed() < shared.session_timeout));
        let cap = shared.max_connections.saturating_mul(4);
        if sessions.len() > cap {
            let mut idle_ones: Vec<([u8; 16], Instant)> =
                sessions.iter().filter_map(|(k, s)| idle(s).map(|t| (*k, t))).collect();
            idle_ones.sort_by_key(|&(_, t)| t);
            for (key, _) in idle_ones.iter().take(sessions.len() - cap) {
                sessions.remove(key);
            }
        }
        if sessions.contains_key(&hello.session) {
            // ORDERING: Relaxed — a statistics counter.
            shared.counters.resumed.fetch_add(1, Ordering::Relaxed);
        }
        sessions.entry(hello.session).or_default().clone()
    };
    // Waits for an insert of the previous owner in progress; after it, that one stores
    // nothing more.
    let (previous, stored) = {
        let _turn = session.turn.lock();
        // ORDERING: SeqCst — see `Session::owner`.
        let previous = session.owner.swap(id, Ordering::SeqCst);
        *session.idle_since.lock() = None;
        // ORDERING: Relaxed — a count read under the table's lock by a snapshot, for which
        // either side of this raise is right (the samples below `first_seq` are in no
        // table of this server).
        let stored = session.stored.fetch_max(hello.first_seq, Ordering::Relaxed);
        (previous, stored.max(hello.first_seq))
    };
    if previous != 0 {
        for conn in shared.conns.lock().iter() {
            if conn.id == previous {
                let _ = conn.writer.lock().shutdown(Shutdown::Both);
            }
        }
    }
    (Owned { id, session, worked: std::sync::Arc::default() }, stored)
}

/// Reads the client's hello; answers it. Returns the hello, the bytes after it, and the
/// shared-memory pipe offered in the reply (a same-host client that asked for one).
pub(super) fn handshake(
    shared: &Shared,
    stream: &mut TcpStream,
    id: u64,
) -> Result<Option<Handshake>, EchoError> {
    let mode = if shared.token.is_some() { Mode::Token } else { Mode::Open };
    let offer = Offer::new(mode)?;
    stream.write_all(&offer.encode())?;
    stream.set_read_timeout(Some(HELLO_TIMEOUT))?;
    let max_body = v2::max_hello_body(&shared.layout);
    let mut received = Vec::new();
    let mut chunk = [0u8; 4096];
    let deadline = Instant::now() + HELLO_TIMEOUT;
    let (hello, body, used) = loop {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Ok(None);
        }
        received.extend_from_slice(&chunk[..n]);
        match v2::parse_opening(&received, &offer, max_body)? {
            Opening::Hello(hello, body, used) => break (hello, body, used),
            Opening::NeedMore if Instant::now() < deadline => {}
            Opening::NeedMore => return Err(EchoError::Protocol("hello timed out".into())),
            Opening::V1 => {
                log::warn!(
                    "refused a wire v1 client (id-echo 0.2.1 or a client without wire v2): \
                     the ragged leaves {} need wire v2",
                    ragged_names(shared)
                );
                // ORDERING: Relaxed — a statistics counter.
                shared.counters.refused.fetch_add(1, Ordering::Relaxed);
                return Ok(None);
            }
        }
    };
    let refuse = |why: Refusal, message: String| Reply::Refused(why, message);
    let refusal = if let Some(token) = &shared.token {
        (!hello.verify(&offer, token, &body))
            .then(|| refuse(Refusal::Auth, "the token is missing or wrong".into()))
    } else {
        None
    };
    let refusal = refusal.or_else(|| {
        shared.layout.mismatch(&hello.layout).map(|why| {
            refuse(
                Refusal::Layout,
                format!("{why} (this server's ragged leaves: {})", ragged_names(shared)),
            )
        })
    });
    let versions = shared.table.versions().is_some();
    let refusal = refusal.or_else(|| {
        (versions && !hello.versions).then(|| {
            refuse(
                Refusal::Layout,
                "this server keeps the policy version of every sample (policy_versions=True \
                 or max_staleness=), and this worker cannot send one"
                    .into(),
            )
        })
    });
    if let Some(reply) = refusal {
        // Counted before the client can read the refusal (and look at the counters).
        // ORDERING: Relaxed — a statistics counter.
        shared.counters.refused.fetch_add(1, Ordering::Relaxed);
        stream.write_all(&reply.encode())?;
        return Ok(None);
    }
    let replay = shared.table.config().sampler != RaggedSampler::Fifo;
    let signed = shared.token.as_deref().map(|t| (t, &*hello, &offer));
    let (owned, resume) = take_session(shared, &hello, id);
    let mut accept = Accept::new(replay, resume, 0, signed);
    // A ragged server's reply names the most samples a group frame may hold.
    accept.steps = Some(u32::try_from(shared.table.config().batch_size).unwrap_or(u32::MAX));
    // Every sample then ends with its version, and the bound a worker keeps to: with
    // `admission="block"` it waits for newer weights more than `max_staleness` behind the
    // latest; with "drop" it never waits (stale samples are dropped as they go in).
    accept.versions = shared.table.versions().map(|v| match (v.admission(), v.max_staleness()) {
        (Admission::Block, Some(k)) => k,
        _ => u64::MAX,
    });
    // Versions announced as they are published (`RaggedTcp::announce`).
    accept.params = hello.params;
    // Persisted notices to a durable worker after each checkpoint (`RaggedTcp::persisted`).
    accept.durable = hello.durable;
    let offered = if hello.shm {
        match shm::offer(shared, stream) {
            Ok(offered) => {
                accept.shm = Some(offered.wire());
                Some(offered)
            }
            Err(why) => {
                accept.note = why;
                None
            }
        }
    } else {
        None
    };
    // Compressed frames from a worker that can send them and has no pipe to copy raw into.
    let codecs = super::packed::wire_codecs(shared, &hello, offered.is_some());
    accept.codecs = (!codecs.is_empty()).then_some(codecs);
    stream.write_all(&Reply::Accepted(accept).encode())?;
    stream.set_read_timeout(None)?;
    // A worker that stops reading its acknowledgements (its receive buffer full) has its
    // connection ended, instead of holding a thread, and `close()`, in a write for ever.
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    Ok(Some((*hello, received[used..].to_vec(), offered, owned)))
}
