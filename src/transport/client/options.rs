//! A client's settings ([`ClientConfig`]): the protocol to speak ([`Protocol`]), whether to
//! use shared memory ([`SharedMemory`]), the window, timeouts, reconnection, and a
//! [`Resolver`] that names the server to (re)connect to.

use std::time::Duration;

use crate::error::EchoError;
use crate::transport::wire::v2::Layout;

/// The `log` target of everything the TCP client logs: the logger `echo.transport.client` in Python,
/// whichever file of the module the record comes from (the user guides name it).
pub(crate) const LOG_TARGET: &str = "echo::transport::client";

/// Which wire protocol to speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// v2 when the server offers it, else v1.
    Auto,
    /// v1 only (as id-echo 0.2.1).
    V1,
    /// v2 only.
    V2,
}

/// Whether to send through same-host shared memory (see [`crate::transport::shm`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedMemory {
    /// TCP only.
    Off,
    /// Shared memory when the server offers it (same host, v2, Linux), else TCP.
    Auto,
    /// Shared memory or an [`EchoError::SharedMemory`] saying why not.
    Required,
}

/// A client's settings.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Server host.
    pub host: String,
    /// Server port.
    pub port: u16,
    /// Our samples: dtypes, names, shapes.
    pub layout: Layout,
    /// Unacknowledged samples allowed before `send` waits.
    pub max_inflight: u64,
    /// Which protocol to speak.
    pub protocol: Protocol,
    /// The shared secret to prove (v2); `None`: none.
    pub token: Option<Vec<u8>>,
    /// The server is dead after this long without a byte from it (v2); `None`: never.
    pub heartbeat_timeout: Option<Duration>,
    /// Reconnect (v2) for up to this long after the connection drops; `None`: do not.
    pub reconnect_timeout: Option<Duration>,
    /// Whether to send through same-host shared memory.
    pub shared_memory: SharedMemory,
    /// Where to connect, asked before every connection attempt (the first and each
    /// reconnection) when set: `host` and `port` are then only its fallback. A client follows
    /// a server that moves this way (a learner restarted on another node and port).
    pub resolver: Option<Resolver>,
    /// How the client names itself in its log lines (besides the server's address).
    pub name: Option<String>,
    /// Compress the leaves the server names in its reply (v2 over TCP; never over shared
    /// memory, which copies raw).
    pub wire_compression: bool,
    /// Durable acknowledgements: `Some(bytes)` keeps every sample until the server says a
    /// completed checkpoint holds it (not only until it is acknowledged), in at most `bytes`
    /// of frames; `send` waits while they are spent. A restored server's session says where
    /// its checkpoint stands, and the client resends from there. Needs reconnection.
    /// `None`: samples are kept until acknowledged.
    pub durable: Option<usize>,
}

/// Where a client connects next ([`ClientConfig::resolver`]).
pub trait Resolve: Send + Sync {
    /// The address to try now. `last` is the address of the previous attempt or connection
    /// and why it ended (`None` before the first attempt). `Ok(None)`: no server to try yet;
    /// the client backs off and asks again until its deadline.
    ///
    /// # Errors
    /// Any error ends the client's attempts: it becomes the error of the call that was
    /// connecting (the first connect, or the `send`/`wait` that was reconnecting).
    fn resolve(&self, last: Option<(&str, u16, &str)>) -> Result<Option<(String, u16)>, EchoError>;
}

/// A shared [`Resolve`] (cloned with the settings).
#[derive(Clone)]
pub struct Resolver(pub std::sync::Arc<dyn Resolve>);

impl std::fmt::Debug for Resolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Resolver(..)")
    }
}

impl ClientConfig {
    /// Settings for `host:port` sending samples of `layout`, with the defaults: 32 in
    /// flight, [`Protocol::Auto`], no token, 10 s heartbeat timeout, no reconnection, TCP
    /// only ([`SharedMemory::Off`]; the Python client defaults to `Auto`).
    pub fn new(host: impl Into<String>, port: u16, layout: Layout) -> Self {
        Self {
            host: host.into(),
            port,
            layout,
            max_inflight: 32,
            protocol: Protocol::Auto,
            token: None,
            heartbeat_timeout: Some(Duration::from_secs(10)),
            reconnect_timeout: None,
            shared_memory: SharedMemory::Off,
            resolver: None,
            name: None,
            wire_compression: true,
            durable: None,
        }
    }

    /// Whether the hello asks for shared memory: not on v1, only on Linux. With
    /// reconnection too: each new connection asks again, and the copies kept for resending go
    /// through whichever path it has.
    pub(super) fn wants_shm(&self) -> bool {
        self.shared_memory != SharedMemory::Off
            && self.protocol != Protocol::V1
            && cfg!(target_os = "linux")
    }

    /// Whether a failed first connection is tried again (until the deadline): with
    /// reconnection (the server may not be up yet) or a resolver (it may know none yet).
    pub(super) fn retries(&self) -> bool {
        self.reconnect_timeout.is_some() || self.resolver.is_some()
    }

    /// How log lines name this client talking to `address`: `name (address)`, or the address.
    pub(super) fn who(&self, address: &str) -> String {
        match &self.name {
            Some(name) => format!("{name} ({address})"),
            None => address.to_owned(),
        }
    }

    pub(super) fn validate(&self) -> Result<(), EchoError> {
        if self.max_inflight == 0 {
            return Err(EchoError::Config(
                "the in-flight window must allow at least 1 sample, got 0".into(),
            ));
        }
        if self.token.as_ref().is_some_and(Vec::is_empty) {
            return Err(EchoError::Config("the token must not be empty".into()));
        }
        if self.protocol == Protocol::V1 && self.token.is_some() {
            return Err(EchoError::Config(
                "a token needs wire protocol 2 (protocol=1 cannot prove it)".into(),
            ));
        }
        if self.protocol == Protocol::V1 && self.reconnect_timeout.is_some() {
            return Err(EchoError::Config(
                "reconnecting needs wire protocol 2 (v1 has no sequence numbers to resume from)"
                    .into(),
            ));
        }
        if let Some(bytes) = self.durable {
            if self.reconnect_timeout.is_none() {
                return Err(EchoError::Config(
                    "durable acknowledgements need reconnection (reconnect=True): the samples \
                     kept until they are persisted are resent on a new connection"
                        .into(),
                ));
            }
            if bytes == 0 {
                return Err(EchoError::Config(
                    "the durable byte budget must be at least 1 byte, got 0".into(),
                ));
            }
        }
        if self.shared_memory == SharedMemory::Required {
            let why = if !cfg!(target_os = "linux") {
                Some("the shared-memory path is Linux-only")
            } else if self.protocol == Protocol::V1 {
                Some("shared memory needs wire protocol 2 (protocol=1 cannot negotiate it)")
            } else {
                None
            };
            if let Some(why) = why {
                return Err(EchoError::SharedMemory(format!("shared_memory=True: {why}")));
            }
        }
        self.layout.spec().map(drop)
    }
}
