//! Transports: where samples come from besides in-process inserts. A transport only accepts
//! connections, reads raw payloads and pushes them into [`Ingress`]
//! connections; ordering, batching and backpressure are the ingress's and store's business.
//!
//! - [`wire`]: the v1 wire format, defined once.
//! - [`tcp`]: the tokio TCP server ([`tcp::TcpServer`]).
//! - [`client`]: a blocking TCP client ([`client::TcpSender`]) for rollout workers.

pub mod client;
pub mod tcp;
pub mod wire;

use std::net::SocketAddr;

use crate::error::EchoError;

/// A running source of samples.
pub trait Transport: Send {
    /// The address it listens on, if any.
    fn local_addr(&self) -> Option<SocketAddr>;
    /// Stops accepting, closes every connection and joins its threads. Idempotent.
    fn shutdown(&mut self) -> Result<(), EchoError>;
}

use std::sync::Arc;

use crate::ingress::{Ingress, IngressConfig, IngressSnapshot};
use crate::store::Sink;

/// A TCP server and the drainer pool behind it, started and stopped together.
pub struct TcpIngress {
    ingress: Arc<Ingress>,
    server: tcp::TcpServer,
}

impl TcpIngress {
    /// Starts the drainers, then binds and starts accepting.
    ///
    /// # Errors
    /// Bad settings ([`EchoError::Config`]) or a failed bind ([`EchoError::Io`], naming the
    /// address); nothing is left running on error.
    pub fn start(
        store: Arc<dyn Sink>,
        ingress: IngressConfig,
        tcp: &tcp::TcpConfig,
    ) -> Result<Self, EchoError> {
        let ingress = Ingress::start(store, ingress)?;
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
        self.server.local_addr().expect("a TCP server has an address")
    }

    /// The drainer pool.
    pub fn ingress(&self) -> Arc<Ingress> {
        Arc::clone(&self.ingress)
    }

    /// The ingress counters.
    pub fn snapshot(&self) -> IngressSnapshot {
        self.ingress.snapshot()
    }

    /// Stops accepting and closes every connection, closes the store (so drainers blocked on a
    /// full ring return), and joins every thread. Idempotent.
    pub fn shutdown(&mut self) {
        let _ = self.server.shutdown();
        self.ingress.store().close();
        self.ingress.shutdown();
    }
}

impl Drop for TcpIngress {
    fn drop(&mut self) {
        self.shutdown();
    }
}
