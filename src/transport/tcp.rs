//! The TCP transport: a tokio runtime of its own, an accept loop, and one task per connection
//! that sends the handshake, reads exact-size samples into recycled buffers, queues them and
//! acknowledges each queued sample with one byte.
//!
//! Reading: small samples arrive many per `read` into a staging buffer and are copied out;
//! samples of at least half the staging size are read straight into their payload buffer, so
//! large samples cost no extra copy. A connection that ends mid-sample has the partial sample
//! discarded: only whole samples are ever queued.
//!
//! Acks are written in runs, right before the task would block (on a read, or on a full
//! queue), so a client streaming many small samples gets one ack write per read, not one per
//! sample, and never waits for an ack that is sitting in our buffer.

use std::io;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use tokio::sync::{Notify, Semaphore};

use super::wire::{encode_handshake, ACK};
use crate::error::EchoError;
use crate::ingress::{Connection, Ingress, SpaceWaker};

/// Bytes read from a socket at a time for small samples.
const STAGING: usize = 64 * 1024;
/// How long `shutdown` waits for the runtime's tasks to stop.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// TCP transport settings.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// Bind address (`0.0.0.0` for every interface, `127.0.0.1` for loopback only).
    pub host: String,
    /// Port; 0 picks a free one.
    pub port: u16,
    /// Tokio worker threads.
    pub num_threads: usize,
    /// Connections served at once; more are accepted and closed at once.
    pub max_connections: usize,
}

/// A running TCP server feeding an [`Ingress`].
pub struct TcpServer {
    runtime: Option<Runtime>,
    local_addr: SocketAddr,
}

impl TcpServer {
    /// Binds `config.host:config.port` (synchronously, so a port in use is reported here) and
    /// starts accepting.
    ///
    /// # Errors
    /// [`EchoError::Config`] for bad settings or a spec the wire format cannot express;
    /// [`EchoError::Io`] (naming the address) if binding or starting the runtime fails.
    pub fn start(config: &TcpConfig, ingress: Arc<Ingress>) -> Result<Self, EchoError> {
        if config.num_threads == 0 {
            return Err(EchoError::Config("num_threads must be >= 1, got 0".into()));
        }
        if config.max_connections == 0 {
            return Err(EchoError::Config("max_connections must be >= 1, got 0".into()));
        }
        let handshake: Arc<[u8]> = encode_handshake(ingress.backend().spec())?.into();
        let addr = (config.host.as_str(), config.port);
        let listener = StdListener::bind(addr).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot listen on {}:{}: {e}", config.host, config.port),
            )
        })?;
        listener.set_nonblocking(true)?;
        let local_addr = listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.num_threads)
            .thread_name("echo-tcp")
            .enable_io()
            .enable_time()
            .build()?;
        let listener = {
            let _entered = runtime.enter();
            TcpListener::from_std(listener)?
        };
        let limit = Arc::new(Semaphore::new(config.max_connections));
        let max = config.max_connections;
        runtime.spawn(accept_loop(listener, ingress, handshake, limit, max));
        Ok(Self { runtime: Some(runtime), local_addr })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, closes every connection and joins the runtime's threads. Idempotent.
    pub fn shutdown(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            // Cancels the accept loop and every connection task at its next await point;
            // their guards mark the connections closed. Joins the worker threads.
            runtime.shutdown_timeout(SHUTDOWN_GRACE);
        }
    }
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

async fn accept_loop(
    listener: TcpListener,
    ingress: Arc<Ingress>,
    handshake: Arc<[u8]>,
    limit: Arc<Semaphore>,
    max: usize,
) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => match Arc::clone(&limit).try_acquire_owned() {
                Ok(permit) => {
                    let (ingress, handshake) = (Arc::clone(&ingress), Arc::clone(&handshake));
                    tokio::spawn(async move {
                        serve(stream, peer, &ingress, &handshake).await;
                        drop(permit);
                    });
                }
                Err(_) => {
                    log::warn!("refusing connection from {peer}: {max} connections already open");
                    drop(stream);
                }
            },
            Err(err) => {
                // Out of file descriptors and the like: back off instead of spinning.
                log::warn!("accept failed: {err}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Wakes a connection task waiting for a free buffer or queue slot.
struct NotifyWaker(Arc<Notify>);

impl SpaceWaker for NotifyWaker {
    fn wake(&self) {
        // `notify_one` stores a permit when nobody waits, so a wake between the task's failed
        // attempt and its `notified().await` is not lost.
        self.0.notify_one();
    }
}

/// Marks the connection closed however the task ends (error, EOF, or runtime shutdown).
struct CloseOnDrop(Arc<Connection>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

async fn serve(stream: TcpStream, peer: SocketAddr, ingress: &Ingress, handshake: &[u8]) {
    match serve_inner(stream, ingress, handshake).await {
        Ok(()) => log::debug!("{peer}: connection closed"),
        Err(err) if is_disconnect(&err) => log::debug!("{peer}: connection lost: {err}"),
        Err(err) => log::warn!("{peer}: connection failed: {err}"),
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

async fn serve_inner(stream: TcpStream, ingress: &Ingress, handshake: &[u8]) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let (mut reader, mut writer) = stream.into_split();
    writer.write_all(handshake).await?;
    let space = Arc::new(Notify::new());
    let conn = ingress.register(Box::new(NotifyWaker(Arc::clone(&space))));
    let _closer = CloseOnDrop(Arc::clone(&conn));
    let payload_size = ingress.backend().spec().payload_size();
    let mut staging = vec![0u8; STAGING.min(payload_size.saturating_mul(64)).max(1)];
    let (mut lo, mut hi) = (0usize, 0usize);
    let mut acks = 0usize;
    loop {
        let mut buf = match conn.take_buffer() {
            Some(buf) => buf,
            None => {
                flush_acks(&mut writer, &mut acks).await?;
                conn.note_blocked();
                loop {
                    space.notified().await;
                    if let Some(buf) = conn.take_buffer() {
                        break buf;
                    }
                }
            }
        };
        let mut filled = 0;
        while filled < payload_size {
            if lo < hi {
                let n = (hi - lo).min(payload_size - filled);
                buf[filled..filled + n].copy_from_slice(&staging[lo..lo + n]);
                (lo, filled) = (lo + n, filled + n);
                continue;
            }
            // About to block on the socket: first let the client know what we have queued.
            flush_acks(&mut writer, &mut acks).await?;
            let direct = payload_size - filled >= staging.len() / 2;
            let n = if direct {
                reader.read(&mut buf[filled..]).await?
            } else {
                reader.read(&mut staging).await?
            };
            if n == 0 {
                // EOF: clean between samples; a partial sample is discarded, never queued.
                conn.return_buffer(buf);
                return if filled == 0 {
                    Ok(())
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("peer closed mid-sample ({filled} of {payload_size} bytes)"),
                    ))
                };
            }
            if direct {
                filled += n;
            } else {
                (lo, hi) = (0, n);
            }
        }
        let mut pending = buf;
        while let Err(back) = conn.try_push(pending) {
            pending = back;
            flush_acks(&mut writer, &mut acks).await?;
            conn.note_blocked();
            space.notified().await;
        }
        acks += 1;
    }
}

async fn flush_acks(writer: &mut OwnedWriteHalf, acks: &mut usize) -> io::Result<()> {
    const ACKS: [u8; 4096] = [ACK; 4096];
    while *acks > 0 {
        let n = (*acks).min(ACKS.len());
        writer.write_all(&ACKS[..n]).await?;
        *acks -= n;
    }
    Ok(())
}
