//! A worker's session across its connections (how many of its samples are stored and
//! persisted, which connection owns it), and a connection's hold on it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

/// A worker's session (its hello's session id), across its connections: how many of its
/// samples are stored, and which connection may store more. A worker that reconnects says
/// how many it has seen acknowledged (`first_seq`) and is told how many are stored
/// (`resume_seq`): it resends exactly the frames after that, so each sample is stored once.
#[derive(Default)]
pub(super) struct Session {
    /// Samples of the worker's frames stored (whole frames: a frame is stored atomically).
    /// Raised under the table's lock with the frame's entry (`insert_from_then`), so that a
    /// checkpoint that reads it under that lock too sees the count that matches its entries.
    pub(super) stored: AtomicU64,
    /// Samples of the session in a completed checkpoint (a restored session: all of its
    /// `stored`): what a durable worker may let go of.
    pub(super) persisted: AtomicU64,
    /// The connection that owns the session (0: none); a connection that lost it to a newer
    /// one of the same worker stores nothing more. Changed under `turn`; read without it
    /// by whoever tells the owner something.
    pub(super) owner: AtomicU64,
    /// Held by the owning connection through each insert (which may wait for room): a
    /// newer connection of the same worker takes the session over between two inserts,
    /// never during one. Nothing else waits for it: a checkpoint reads `stored` under the
    /// table's lock and `persisted` and `owner` as they are.
    pub(super) turn: Mutex<()>,
    /// Since when no connection owns it.
    pub(super) idle_since: Mutex<Option<Instant>>,
}

impl Session {
    /// The connection that owns it now (0: none).
    pub(super) fn owner(&self) -> u64 {
        // ORDERING: SeqCst — with `persisted` (see `RaggedTcp::persisted`): a checkpoint
        // raises `persisted` then reads the owner, a new owner is set then reads
        // `persisted`, so one of the two tells the new connection.
        self.owner.load(Ordering::SeqCst)
    }

    /// Samples of it in a completed checkpoint.
    pub(super) fn persisted(&self) -> u64 {
        // ORDERING: SeqCst — see `owner`.
        self.persisted.load(Ordering::SeqCst)
    }
}

/// A connection's hold on its worker's session.
pub(super) struct Owned {
    pub(super) id: u64,
    pub(super) session: Arc<Session>,
    /// The connection has stored a frame: a working connection, never evicted for a
    /// newcomer (see `accept_loop`).
    pub(super) worked: Arc<AtomicBool>,
}

impl Owned {
    pub(super) fn stored_one(&self) {
        // ORDERING: Relaxed — a flag read on its own by the accept loop.
        self.worked.store(true, Ordering::Relaxed);
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        let _turn = self.session.turn.lock();
        if self.session.owner() == self.id {
            // ORDERING: SeqCst — see `Session::owner`.
            self.session.owner.store(0, Ordering::SeqCst);
            *self.session.idle_since.lock() = Some(Instant::now());
        }
    }
}
