//! One connection's task from accept to end: greets (the v1 handshake and the v2 offer),
//! negotiates v1 or a v2 hello, hands over to the sample loops of [`super::frames`], and logs
//! how the connection ended (failures throttled).

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::Notify;

use super::frames::{serve_v1, serve_v2};
use super::link::{invalid, is_closing, Link, STAGING};
use super::session::LOG_TARGET;
use super::session::{Activity, CloseOnDrop, NotifyWaker, Shared, HELLO_TIMEOUT, PREFIX_GRACE};
use crate::error::EchoError;
use crate::ingress::{Ingress, TransportEvent};
use crate::transport::wire::v2::{self, Offer, Opening, Refusal};

/// Counts a connection in `active_connections` while its task runs.
pub(super) struct Open<'a>(pub(super) &'a Ingress);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.connection_ended();
    }
}

pub(super) async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    shared: &Shared,
    id: u64,
    activity: &Activity,
) {
    shared.ingress.connection_opened();
    let _open = Open(&shared.ingress);
    match serve_inner(stream, peer, shared, id, activity).await {
        Ok(()) => log::debug!(target: LOG_TARGET, "{peer}: connection closed"),
        Err(err) if is_disconnect(&err) => {
            log::debug!(target: LOG_TARGET, "{peer}: connection lost: {err}")
        }
        Err(err) => shared.failures.log(&format!("{peer}: connection failed: {err}")),
    }
}

fn is_disconnect(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
    )
}

async fn serve_inner(
    stream: TcpStream,
    peer: SocketAddr,
    shared: &Shared,
    id: u64,
    activity: &Activity,
) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let (reader, writer) = stream.into_split();
    let payload_size = shared.ingress.backend().spec().payload_size();
    let mut link = Link {
        reader,
        writer,
        staging: Vec::new(),
        lo: 0,
        hi: 0,
        // Allocated at the first read, so a connection that never sends holds no staging
        // memory.
        staging_len: STAGING.min(payload_size.saturating_mul(64)).max(1),
        acks: 0,
        beat: None,
        last_write: Instant::now(),
        last_heard: Instant::now(),
        activity,
        epoch: shared.epoch,
        closing: shared.closing.subscribe(),
        notices: None,
        versions: None,
    };
    let offer = Offer::new(shared.mode()).map_err(|e| io::Error::other(e.to_string()))?;
    let mut greeting = shared.v1_handshake.clone();
    greeting.extend_from_slice(&offer.encode());
    link.write(&greeting).await?;
    let ingress = &shared.ingress;
    match negotiate(&mut link, &offer, shared.max_hello).await {
        Ok(None) => Ok(()),
        Ok(Some(Opening::V1)) if shared.token.is_some() => {
            // It did not read our greeting as v1 (there was no v1 handshake), yet sends data.
            ingress.note(TransportEvent::RefusedProtocol);
            Err(invalid("sent v1 data to a server with a token (v2 only)".into()))
        }
        Ok(Some(Opening::V1)) => {
            ingress.note(TransportEvent::V1);
            // ORDERING: Relaxed — a once-only flag for a log line; it orders nothing.
            if ingress.backend().sequence().is_some()
                && !shared.warned_v1_sequence.swap(true, std::sync::atomic::Ordering::Relaxed)
            {
                log::warn!(
                    target: LOG_TARGET,
                    "{peer}: a wire v1 client (id-echo 0.2.1, or TcpClient(protocol=1)) sends to \
                     this sequence table: v1 has no episode flags, so its samples are steps of one \
                     stream and its connection one episode, ended as truncated only when the \
                     connection ends; connect with protocol 2 to end episodes (said once per server)"
                );
            }
            let space = Arc::new(Notify::new());
            let conn = ingress.register(Box::new(NotifyWaker(Arc::clone(&space))));
            let _closer = CloseOnDrop(Arc::clone(&conn));
            match serve_v1(&mut link, &conn, &space).await {
                Err(err) if is_closing(&err) => {
                    link.closing_notice(false).await;
                    Ok(())
                }
                other => other,
            }
        }
        Ok(Some(Opening::Hello(hello, body, _))) => {
            match serve_v2(&mut link, peer, shared, id, &offer, &hello, &body).await {
                Err(err) if is_closing(&err) => {
                    link.closing_notice(hello.notices).await;
                    Ok(())
                }
                other => other,
            }
        }
        Ok(Some(Opening::NeedMore)) => unreachable!("negotiate returns whole openings"),
        // The peer went away (or reset) before it said anything we could judge.
        Err(EchoError::Io(err)) => Err(err),
        Err(err) => {
            ingress.note(TransportEvent::RefusedProtocol);
            link.refuse(Refusal::Protocol, &err.to_string()).await;
            Err(invalid(format!("refused: {err}")))
        }
    }
}

/// Reads the client's first bytes until they are v1 data or a whole v2 hello. `None`: the
/// client closed without sending anything.
pub(super) async fn negotiate(
    link: &mut Link<'_>,
    offer: &Offer,
    max_hello: usize,
) -> Result<Option<Opening>, EchoError> {
    let mut received = Vec::new();
    let mut first_bytes_at = Instant::now();
    loop {
        match v2::parse_opening(&received, offer, max_hello)? {
            Opening::NeedMore => {}
            Opening::V1 => {
                link.stage(received);
                return Ok(Some(Opening::V1));
            }
            Opening::Hello(hello, body, len) => {
                link.stage(received.split_off(len));
                return Ok(Some(Opening::Hello(hello, body, len)));
            }
        }
        let mut chunk = [0u8; 4096];
        let read = link.reader.read(&mut chunk);
        // Nothing yet: a v1 worker may compute for a long time before its first sample.
        // Part of the nonce: a v2 client writes its hello at once, so a stall means v1 data
        // that happens to start like the nonce. The whole nonce (32 random hex digits, which
        // v1 data matches with probability 2^-128): a hello, however slowly it arrives, up to
        // HELLO_TIMEOUT after its first bytes.
        let n = if received.is_empty() {
            let n = read.await?;
            first_bytes_at = Instant::now();
            n
        } else if received.len() < v2::NONCE_LEN {
            match tokio::time::timeout(PREFIX_GRACE, read).await {
                Ok(n) => n?,
                Err(_) => {
                    link.stage(received);
                    return Ok(Some(Opening::V1));
                }
            }
        } else {
            let left = HELLO_TIMEOUT.saturating_sub(first_bytes_at.elapsed());
            match tokio::time::timeout(left, read).await {
                Ok(n) => n?,
                Err(_) => {
                    return Err(EchoError::Protocol(format!(
                        "the hello did not arrive within {HELLO_TIMEOUT:?} ({} bytes of it did)",
                        received.len()
                    )))
                }
            }
        };
        link.activity.read(link.epoch);
        if n == 0 {
            if received.is_empty() {
                return Ok(None);
            }
            if received.len() >= v2::NONCE_LEN {
                return Err(EchoError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("peer closed in its hello ({} bytes of it)", received.len()),
                )));
            }
            // v1 data that happens to start like the nonce, then the end of the stream: its
            // whole samples are still queued, the rest discarded, as for any v1 client.
            link.stage(received);
            return Ok(Some(Opening::V1));
        }
        received.extend_from_slice(&chunk[..n]);
    }
}
