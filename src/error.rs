//! The core's one error type. It knows nothing about Python: `src/python/errors.rs` maps each
//! variant onto the exception a Python user expects.

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
    /// A priority (or a priority update) is invalid (maps to `ValueError`).
    #[error("{0}")]
    Priority(String),
    /// The ring could not be allocated (maps to `MemoryError`).
    #[error("cannot allocate {bytes} bytes for the ring buffer")]
    OutOfMemory {
        /// Bytes requested for one leaf's buffer.
        bytes: usize,
    },
    /// The store was closed; nothing more goes in or comes out (maps to `ServerClosedError`).
    #[error("the server is closed")]
    Closed,
    /// An operating-system error (maps to the matching `OSError`).
    #[error(transparent)]
    Io(#[from] std::io::Error),
}
