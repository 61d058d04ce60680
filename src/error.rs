//! The core's errors. They know nothing about Python: `src/python/errors.rs` maps each
//! variant onto the exception a Python user expects, in one place.
//!
//! Two layers, no more:
//! - [`EchoError`]: what went wrong, for every module (stores, replay tables, the ingress,
//!   the wire format and the TCP client).
//! - [`InsertError`]: an insert of several samples that stopped early carries how many went
//!   in before the [`EchoError`] that stopped it, so a caller can resume or account for them.
//!
//! The sum tree keeps its own small error (`replay::sumtree::SumTreeError`) for the states a
//! caller checks for; it converts into [`EchoError`] where it leaves the replay module.

/// Everything that can go wrong in the core.
#[derive(Debug, thiserror::Error)]
pub enum EchoError {
    /// An argument or configuration value is out of range (maps to `ValueError`).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A sample's leaf does not have the byte size its spec requires (maps to `ValueError`).
    #[error("leaf {leaf}: expected {expected} bytes, got {got}")]
    SizeMismatch {
        /// Index of the leaf in flattened order.
        leaf: usize,
        /// Bytes the spec requires.
        expected: usize,
        /// Bytes that arrived.
        got: usize,
    },
    /// A concatenated payload has the wrong total size (maps to `ValueError`).
    #[error("payload: expected {expected} bytes, got {got}")]
    PayloadSize {
        /// Bytes a payload must have.
        expected: usize,
        /// Bytes that arrived.
        got: usize,
    },
    /// A sample has the wrong number of leaves (maps to `ValueError`).
    #[error("expected {expected} leaves, got {got}")]
    LeafCount {
        /// Leaves the spec has.
        expected: usize,
        /// Leaves that arrived.
        got: usize,
    },
    /// A priority (or a priority update) is invalid, or the store has no priorities (maps to
    /// `ValueError`).
    #[error("{0}")]
    Priority(String),
    /// A sample the buffer cannot take as it is: a ragged leaf longer than its `max_len`,
    /// unequal lengths in a length group, more rows than a batch's token budget, a group
    /// larger than a batch (maps to `ValueError`). Nothing of it was stored.
    #[error("{0}")]
    Sample(String),
    /// Memory could not be allocated (maps to `MemoryError`).
    #[error("cannot allocate {bytes} bytes of memory for the table")]
    OutOfMemory {
        /// Bytes requested for one leaf's buffer.
        bytes: usize,
    },
    /// The store was closed; nothing more goes in or comes out (maps to `ServerClosedError`).
    #[error("the server is closed")]
    Closed,
    /// A remote server said it closed for good (maps to `ServerClosedError`).
    #[error("{0}")]
    ServerClosed(String),
    /// A deadline passed before the call could complete; nothing is lost and the same call can
    /// be repeated (maps to `TimeoutError`).
    #[error("timed out")]
    TimedOut,
    /// The peer does not speak echo's wire protocol, or describes samples it cannot hold
    /// (maps to `ValueError`).
    #[error("{0}")]
    Protocol(String),
    /// The peer does not know the token, or we cannot prove it to the peer (maps to
    /// `PermissionError`).
    #[error("{0}")]
    Auth(String),
    /// The connection is gone: closed by us, or the peer went away (maps to
    /// `ConnectionClosedError`).
    #[error("connection closed: {0}")]
    Disconnected(String),
    /// A deadline passed in the middle of writing a sample to a peer that applies
    /// backpressure: the sample is partly on the wire, so the same send must be repeated to
    /// finish it (or the connection aborted).
    #[error("the write of a sample is in progress")]
    Stalled,
    /// The operation cannot run now because another one of its kind is running (a second
    /// checkpoint of the same table) (maps to `RuntimeError`).
    #[error("{0}")]
    Busy(String),
    /// Shared memory was required (`shared_memory=True`) and cannot be had; the message says
    /// why (maps to `SharedMemoryError`, a `ConnectionError`).
    #[error("{0}")]
    SharedMemory(String),
    /// A checkpoint cannot be restored: a file is missing, truncated, corrupted or not what
    /// the manifest says, the manifest is malformed or newer than this echo reads, or the
    /// example does not match; the message names the file (maps to
    /// `echo.CheckpointError`, a `ValueError`).
    #[error("{0}")]
    Checkpoint(String),
    /// An operating-system error (maps to the matching `OSError`).
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// An insert that stopped before every sample of its source went in.
#[derive(Debug, thiserror::Error)]
#[error("{error} ({inserted} samples were inserted)")]
pub struct InsertError {
    /// Samples of the source inserted (committed, in order) before `error`. Always 0 for
    /// input errors: the whole source is validated before anything is written.
    pub inserted: usize,
    /// Why it stopped: [`EchoError::Closed`], [`EchoError::TimedOut`], or an input error.
    #[source]
    pub error: EchoError,
}

impl InsertError {
    /// Stopped by `error` after `inserted` samples.
    pub fn new(inserted: usize, error: EchoError) -> Self {
        Self { inserted, error }
    }

    /// Whether nothing went in because the deadline passed first (the insert can simply be
    /// repeated).
    pub fn is_timeout_before_any(&self) -> bool {
        self.inserted == 0 && matches!(self.error, EchoError::TimedOut)
    }
}

impl From<EchoError> for InsertError {
    /// An error before anything was inserted (input errors).
    fn from(error: EchoError) -> Self {
        Self { inserted: 0, error }
    }
}
