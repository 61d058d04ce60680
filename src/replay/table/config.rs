//! What a replay table is built with and what it reports: [`ReplayConfig`] (validated once,
//! when the table is built), [`ReplayStats`], and the per-item values a batch carries after
//! the sample's leaves ([`BATCH_META`]).

use crate::codec::Codec;
use crate::error::EchoError;
use crate::replay::limiter::RateLimit;
use crate::replay::select::{RemoverKind, SamplerKind};

/// The `log` target of everything the replay table logs: the logger `echo.replay.table` in Python,
/// whichever file of the module the record comes from (the user guides name it).
pub(crate) const LOG_TARGET: &str = "echo::replay::table";

/// One per-item value a replay batch carries after the sample's own leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaLeaf {
    /// What it is called where a batch is handed out (`Sample.keys`, ...).
    pub name: &'static str,
    /// Its element type as a numpy type character: `u` unsigned, `f` floating point, `b` bool.
    pub kind: char,
    /// Bytes per element (native byte order).
    pub bytes: usize,
    /// One value per step of a window (a sequence table's `mask`) rather than one per item.
    pub per_step: bool,
}

/// The per-item values of a replay batch, in the order the batch area stores them after the
/// sample's leaves: the item's key, the probability it was drawn with, and how many times it
/// has been sampled (this draw included). The one definition of that layout: the batch area
/// is built from it, [`ReplayConsumer`](super::ReplayConsumer) writes `Drawn::write_meta` in this order, and the
/// bindings describe the arrays from it.
pub const BATCH_META: [MetaLeaf; 3] = [
    MetaLeaf { name: "keys", kind: 'u', bytes: 8, per_step: false },
    MetaLeaf { name: "probabilities", kind: 'f', bytes: 8, per_step: false },
    MetaLeaf { name: "times_sampled", kind: 'u', bytes: 4, per_step: false },
];

/// How a replay table samples, evicts and paces. Build with [`ReplayConfig::new`] and adjust
/// the public fields.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayConfig {
    /// Items per batch.
    pub batch_size: usize,
    /// Items the table holds before the remover evicts one per insert.
    pub max_size: usize,
    /// How items are drawn.
    pub sampler: SamplerKind,
    /// Which item is evicted when the table is full.
    pub remover: RemoverKind,
    /// When inserts and samples may proceed.
    pub rate_limit: RateLimit,
    /// Remove an item once it was sampled this many times; 0 never does.
    pub max_times_sampled: u32,
    /// Fixes the sampling sequence (for reproducible runs); `None` seeds from the OS.
    pub seed: Option<u64>,
    /// How each leaf is stored: `None` as is, `Some(codec)` compressed ([`Codec`]). Empty:
    /// no leaf is compressed.
    pub compress: Vec<Option<Codec>>,
    /// Bounds the bytes the items take (their compressed leaves as stored, the others raw):
    /// the remover evicts until a new item fits, as it does at `max_size` items. `None`: only
    /// `max_size` bounds the table.
    pub max_bytes: Option<u64>,
}

impl ReplayConfig {
    /// Uniform sampling, FIFO eviction, `MinSize(1)`, unlimited `max_times_sampled`.
    pub fn new(batch_size: usize, max_size: usize) -> Self {
        Self {
            batch_size,
            max_size,
            sampler: SamplerKind::Uniform,
            remover: RemoverKind::Fifo,
            rate_limit: RateLimit::MinSize(1),
            max_times_sampled: 0,
            seed: None,
            compress: Vec::new(),
            max_bytes: None,
        }
    }

    pub(super) fn validate(&self) -> Result<usize, EchoError> {
        let config = |msg: String| Err(EchoError::Config(msg));
        let (batch_size, max_size) = (self.batch_size, self.max_size);
        if batch_size < 1 {
            return config(format!("batch_size must be >= 1, got {batch_size}"));
        }
        if max_size < batch_size {
            return config(format!(
                "max_size must be >= batch_size ({batch_size}), got {max_size}"
            ));
        }
        let slots = max_size
            .checked_add(batch_size)
            .filter(|&s| s < u32::MAX as usize)
            .ok_or_else(|| {
                EchoError::Config(format!(
                    "max_size + batch_size must be below 2^32 - 1, got {max_size} + {batch_size}"
                ))
            })?;
        self.rate_limit.validate(max_size as u64)?;
        if self.max_bytes == Some(0) {
            return config("max_bytes must be >= 1, got 0".to_owned());
        }
        Ok(slots)
    }
}

/// A snapshot of a table's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayStats {
    /// Items that can be sampled now.
    pub size: u64,
    /// Inserts that hold a slot and are still copying.
    pub pending_inserts: u64,
    /// Items ever inserted (published).
    pub inserted: u64,
    /// Items ever handed out (a batch counts `batch_size`).
    pub sampled_items: u64,
    /// Batches ever handed out.
    pub batches: u64,
    /// Items evicted by the remover because the table was full.
    pub evicted: u64,
    /// Items removed because they reached `max_times_sampled`.
    pub removed_max_times_sampled: u64,
    /// Priorities changed by `update_priorities`.
    pub priority_updates: u64,
    /// Keys `update_priorities` ignored because they were unknown or already removed.
    pub unknown_keys: u64,
    /// Total nanoseconds inserts spent waiting for the rate limiter.
    pub insert_blocked_ns: u64,
    /// Total nanoseconds `sample` spent waiting for items or the rate limiter.
    pub sample_blocked_ns: u64,
    /// Bytes the table's items take as stored, compressed leaves compressed (items still
    /// being written included).
    pub stored_bytes: u64,
    /// Bytes the same items take raw (their number times the sample's size).
    pub raw_bytes: u64,
}
