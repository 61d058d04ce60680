//! What a sample's fields must satisfy for the backend they go to: a priority it accepts,
//! steps only for a sequence table, rows below its [`max_rows`]. The TCP frames
//! ([`check_frame`]) and the shared-memory slots ([`check_meta`], called by
//! [`crate::transport::shm`]) pass the same checks.

use crate::backend::Backend;
use crate::transport::wire::v2::FrameMeta;

/// The rows a client may send steps of: a sequence table's `max_streams` (capped to the
/// wire's u32); `None` for the other backends, which take no step frames.
pub(super) fn max_rows(backend: &Backend) -> Option<u32> {
    backend.sequence().map(|s| u32::try_from(s.max_streams).unwrap_or(u32::MAX))
}

/// A sample frame's fields (the `rest_len` bytes after its kind), checked against what the
/// backend takes: a priority it accepts, steps only for a sequence table, rows below its
/// `max_rows`. The error says what was wrong, for the error frame.
pub(super) fn check_frame(backend: &Backend, kind: u8, rest: &[u8]) -> Result<FrameMeta, String> {
    let meta = FrameMeta::decode(kind, rest).map_err(|e| e.to_string())?;
    check_meta(backend, &meta)?;
    Ok(meta)
}

/// What [`check_frame`] checks of a sample's fields, for frames and shared-memory slots alike.
pub(crate) fn check_meta(backend: &Backend, meta: &FrameMeta) -> Result<(), String> {
    if let Some(priority) = meta.priority {
        backend.check_priority(priority).map_err(|e| e.to_string())?;
    }
    if !meta.is_step() {
        return Ok(());
    }
    match max_rows(backend) {
        None => Err("steps of episodes (a row or an episode end) need a sequence table; this \
                     server did not offer them"
            .to_owned()),
        Some(max) if meta.row >= max => Err(format!(
            "row {} out of range: this sequence table takes rows 0 to {} per client \
             (Sequence(max_streams={max}))",
            meta.row,
            max - 1
        )),
        Some(_) => Ok(()),
    }
}
