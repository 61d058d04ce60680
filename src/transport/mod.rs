//! Transports: where samples come from besides in-process inserts. A transport accepts
//! connections, reads raw payloads and pushes them into [`Ingress`] connections; ordering,
//! batching and backpressure are the ingress's and the backend's business, with two
//! exceptions that save a copy (`direct`). Shared memory is not a second transport but a path
//! a v2 TCP connection negotiates; a second transport would be a second type next to
//! [`tcp::TcpServer`] feeding the same [`Ingress`], and a common trait waits until there is
//! something to abstract over.
//!
//! - [`wire`]: the wire format (v1 and v2), defined once.
//! - [`tcp`]: the tokio TCP server ([`tcp::TcpServer`]).
//! - [`client`]: a blocking TCP client ([`client::TcpSender`]) for rollout workers.
//! - [`shm`]: the same-host shared-memory channel a v2 connection may negotiate (Linux), both
//!   sides of it, and its ring's index protocol.
//! - `direct`: the two paths on which a transport writes into the backend itself.
//!
//! Under loom only [`shm::ring`] is compiled (its loom models check it).

#[cfg(not(loom))]
pub mod client;
#[cfg(not(loom))]
mod direct;
pub mod shm;
#[cfg(not(loom))]
pub mod tcp;
#[cfg(not(loom))]
pub mod wire;

#[cfg(not(loom))]
use std::net::SocketAddr;
#[cfg(not(loom))]
use std::sync::Arc;

#[cfg(not(loom))]
use crate::backend::Backend;
#[cfg(not(loom))]
use crate::error::EchoError;
#[cfg(not(loom))]
use crate::ingress::{Ingress, IngressConfig, IngressSnapshot};

/// A TCP server and the drainer pool behind it, started and stopped together.
#[cfg(not(loom))]
pub struct TcpIngress {
    ingress: Arc<Ingress>,
    server: tcp::TcpServer,
}

#[cfg(not(loom))]
impl TcpIngress {
    /// Starts the drainers, then binds and starts accepting.
    ///
    /// # Errors
    /// Bad settings ([`EchoError::Config`]) or a failed bind ([`EchoError::Io`], naming the
    /// address); nothing is left running on error.
    pub fn start(
        backend: Backend,
        ingress: IngressConfig,
        tcp: &tcp::TcpConfig,
    ) -> Result<Self, EchoError> {
        let ingress = Ingress::start(backend, ingress)?;
        match tcp::TcpServer::start(tcp, Arc::clone(&ingress)) {
            Ok(server) => Ok(Self { ingress, server }),
            Err(err) => {
                ingress.shutdown();
                Err(err)
            }
        }
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// What a checkpoint asks of the durable sessions ([`tcp::TcpServer::durability`]).
    pub fn durability(&self) -> tcp::Durability {
        self.server.durability()
    }

    /// The drainer pool.
    pub fn ingress(&self) -> Arc<Ingress> {
        Arc::clone(&self.ingress)
    }

    /// The ingress counters.
    pub fn snapshot(&self) -> IngressSnapshot {
        self.ingress.snapshot()
    }

    /// Stops accepting and closes every connection (nothing more is read or acknowledged),
    /// telling the clients `why` ([`tcp::TcpServer::close`]), but leaves the drainers
    /// running: what the connections queued still goes into the backend. For a drain, and
    /// the first step of a close; [`TcpIngress::shutdown`] ends the rest. Idempotent.
    pub fn stop_accepting(&mut self, why: wire::v2::Closing) {
        self.server.close(why);
    }

    /// Stops accepting and closes every connection, closes the backend (so drainers blocked on a
    /// full ring return), and joins every thread. Idempotent.
    pub fn shutdown(&mut self) {
        self.server.shutdown();
        self.ingress.backend().close();
        self.ingress.shutdown();
    }
}

#[cfg(not(loom))]
impl Drop for TcpIngress {
    fn drop(&mut self) {
        self.shutdown();
    }
}
