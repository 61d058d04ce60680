//! Admission at the connection limit: a newcomer takes the place of the oldest connection
//! that has stored nothing (in its handshake or past it), so idle or hostile peers cannot
//! lock workers out.

use std::net::Shutdown;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::Shared;

/// How long a newcomer waits for the slot of the connection evicted for it.
const EVICTION_GRACE: Duration = Duration::from_secs(1);

/// Whether a newcomer may be served: a slot is free, or one is freed for it by evicting the
/// oldest connection that has not stored a frame (an idle or hostile peer, in its
/// handshake or past it, which a worker about to send would reconnect from); refused only
/// when every connection is a working one. So silent connections cannot lock workers out, and a
/// working connection (also one held back by a full table) is never dropped for a newcomer.
pub(super) fn admit(shared: &Shared) -> bool {
    // ORDERING: Relaxed — a gauge; the bound is approximate by a connection or two.
    let full = || shared.counters.active.load(Ordering::Relaxed) as usize >= shared.max_connections;
    if !full() {
        return true;
    }
    // The oldest handshake not done, or else the oldest connection that stored nothing
    // whose writer is free now (one writing to a peer that does not read is skipped: its
    // write times out on its own).
    let oldest_handshake = shared
        .handshaking
        .lock()
        .iter()
        .min_by_key(|(id, _)| *id)
        .map(|(id, stream)| (*id, stream.try_clone()));
    let idle: Vec<_> = {
        let mut conns: Vec<_> = shared
            .conns
            .lock()
            .iter()
            // ORDERING: Relaxed — see `Owned::stored_one`.
            .filter(|c| !c.worked.load(Ordering::Relaxed))
            .map(|c| (c.id, c.writer.clone()))
            .collect();
        conns.sort_by_key(|&(id, _)| id);
        conns
    };
    let evicted = match oldest_handshake {
        Some((id, Ok(stream))) if idle.first().is_none_or(|(idle, _)| id < *idle) => {
            stream.shutdown(Shutdown::Both).is_ok()
        }
        _ => idle.iter().any(|(_, writer)| {
            writer
                .try_lock_for(Duration::from_millis(20))
                .is_some_and(|w| w.shutdown(Shutdown::Both).is_ok())
        }),
    };
    if !evicted {
        return false;
    }
    // ORDERING: Relaxed — a statistics counter.
    shared.counters.evicted.fetch_add(1, Ordering::Relaxed);
    let until = Instant::now() + EVICTION_GRACE;
    while full() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(2));
    }
    !full()
}
