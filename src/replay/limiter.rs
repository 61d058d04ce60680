//! Rate limiters: when a table lets writers insert and the consumer sample.
//!
//! One mechanism covers all three kinds, with DeepMind Reverb's meaning. The limiter keeps
//! `inserts` (items ever inserted, counted when their slot is reserved), `samples` (items
//! ever handed out; a batch of `b` counts `b`) and a target `samples_per_insert`. Their
//! *diff* `inserts * samples_per_insert - samples` must stay inside `[min_diff, max_diff]`:
//!
//! - a sample of `n` items is allowed when the table holds at least `min_size_to_sample`
//!   items and `diff - n >= min_diff`;
//! - an insert is allowed when `diff + samples_per_insert <= max_diff`, or while the table
//!   holds fewer than `min_size_to_sample` items (so evictions can never starve sampling).
//!
//! | kind | samples_per_insert | min_size_to_sample | min_diff | max_diff |
//! |---|---|---|---|---|
//! | `MinSize(n)` | 1 | n | -inf | +inf |
//! | `SampleToInsertRatio(r, n, e)` | r | n | `n*r - e` | `n*r + e` |
//! | `Queue(size)` | 1 | 1 | 0 | size |
//!
//! The table draws a batch in rounds of what the limiter allows, so a batch larger than the
//! error buffer does not deadlock: it waits for inserts part-way (see `table.rs`). Hence
//! the no-deadlock condition is per item: `max_diff - min_diff >= 2 * max(1, r)`, checked by
//! [`RateLimit::validate`].

use crate::error::EchoError;

/// Which rate limiter a replay table uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RateLimit {
    /// Sampling waits until the table holds `min_size` items; inserts never wait.
    MinSize(u64),
    /// Keep `samples / inserts` near `samples_per_insert`, within a window of `max_diff -
    /// min_diff` (Reverb's `error_buffer` is half of it, centred on `min_size_to_sample *
    /// samples_per_insert`).
    SampleToInsertRatio {
        /// Target number of times each item is sampled, on average.
        samples_per_insert: f64,
        /// Sampling waits until the table holds this many items.
        min_size_to_sample: u64,
        /// Lower bound on `inserts * samples_per_insert - samples` (samples wait below it).
        min_diff: f64,
        /// Upper bound on it (inserts wait above it).
        max_diff: f64,
    },
    /// A queue of at most `size` unsampled items: inserts wait when it is full, samples when
    /// it is empty.
    Queue(u64),
}

impl RateLimit {
    /// Reverb's `SampleToInsertRatio(samples_per_insert, min_size_to_sample, error_buffer)`.
    pub fn sample_to_insert_ratio(
        samples_per_insert: f64,
        min_size_to_sample: u64,
        error_buffer: f64,
    ) -> Self {
        #[allow(clippy::cast_precision_loss)] // sizes far below 2^52
        let centre = min_size_to_sample as f64 * samples_per_insert;
        Self::SampleToInsertRatio {
            samples_per_insert,
            min_size_to_sample,
            min_diff: centre - error_buffer,
            max_diff: centre + error_buffer,
        }
    }

    /// Checks the parameters that do not depend on the table: a positive, finite
    /// `samples_per_insert` and a window wide enough that inserts and samples can never block
    /// each other for good (`max_diff - min_diff >= 2 * max(1, samples_per_insert)`). The one
    /// place this is checked: the Python strategy objects call it when they are built.
    ///
    /// # Errors
    /// [`EchoError::Config`] saying what the value must be and what it is.
    pub fn check(&self) -> Result<(), EchoError> {
        let Self::SampleToInsertRatio { samples_per_insert, min_diff, max_diff, .. } = *self else {
            return Ok(());
        };
        let config = |msg: String| Err(EchoError::Config(msg));
        if !(samples_per_insert.is_finite() && samples_per_insert > 0.0) {
            return config(format!(
                "SampleToInsertRatio: samples_per_insert must be a finite number > 0, got {samples_per_insert:?}"
            ));
        }
        if !(min_diff.is_finite() && max_diff.is_finite()) {
            return config(format!(
                "SampleToInsertRatio: error_buffer must be finite, got the window ({min_diff:?}, {max_diff:?})"
            ));
        }
        let need = 2.0 * samples_per_insert.max(1.0);
        let width = max_diff - min_diff;
        if width < need {
            return config(format!(
                "SampleToInsertRatio: the error buffer must span at least 2 * max(1, samples_per_insert) = {need:?} \
                 (error_buffer >= {:?}), got {:?} (the window ({min_diff:?}, {max_diff:?})); a narrower window \
                 blocks inserts and samples forever",
                need / 2.0,
                width / 2.0,
            ));
        }
        Ok(())
    }

    /// [`RateLimit::check`], then the sizes against a table of `max_size` items.
    ///
    /// # Errors
    /// [`EchoError::Config`] naming the parameter, what it must be and what it is.
    pub fn validate(&self, max_size: u64) -> Result<(), EchoError> {
        self.check()?;
        let (what, n) = match *self {
            Self::Queue(size) if size < 1 => {
                return Err(EchoError::Config(format!(
                    "Queue(size): size must be >= 1, got {size}"
                )))
            }
            Self::Queue(_) => return Ok(()),
            Self::MinSize(n) => ("MinSize(min_size): min_size", n),
            Self::SampleToInsertRatio { min_size_to_sample, .. } => {
                ("SampleToInsertRatio: min_size_to_sample", min_size_to_sample)
            }
        };
        if n < 1 || n > max_size {
            return Err(EchoError::Config(format!(
                "{what} must be in 1..=max_size ({max_size}), got {n}"
            )));
        }
        Ok(())
    }
}

impl std::fmt::Display for RateLimit {
    /// The limiter as Python spells it (`MinSize(min_size=1)`, the default of a replay
    /// server), for messages.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Self::MinSize(n) => write!(f, "MinSize(min_size={n})"),
            Self::Queue(size) => write!(f, "Queue(size={size})"),
            Self::SampleToInsertRatio {
                samples_per_insert,
                min_size_to_sample,
                min_diff,
                max_diff,
            } => write!(
                f,
                "SampleToInsertRatio(samples_per_insert={samples_per_insert:?}, \
                 min_size_to_sample={min_size_to_sample}, error_buffer=({min_diff:?}, {max_diff:?}))"
            ),
        }
    }
}

/// What held a replay `sample` back when its deadline passed: the limiter and its counters
/// at that moment, under the table's lock. It tells a user waiting on the rate limiter (a
/// configuration question) from one waiting on an empty table (a producer question).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleHoldback {
    /// The table's rate limiter.
    pub limit: RateLimit,
    /// Items ever inserted, as the limiter counts them (when their slot is reserved).
    pub inserts: u64,
    /// Items ever handed out, as the limiter counts them (a batch of `b` counts `b`).
    pub samples: u64,
    /// Sampleable items in the table.
    pub live: u64,
    /// Items of the unfinished batch drawn so far; they stay reserved for the next call.
    pub drawn: usize,
    /// Items per batch.
    pub batch_size: usize,
}

impl SampleHoldback {
    /// Whether the rate limiter holds sampling back, rather than an empty table (where no
    /// limiter setting would help: nothing was inserted, or everything was removed).
    pub fn is_rate_limited(&self) -> bool {
        self.live > 0
    }

    /// One sentence for a timeout message, naming the limiter as `limiter` (its Python
    /// `repr`; [`RateLimit`]'s `Display` gives the same).
    pub fn explain(&self, limiter: &str) -> String {
        let Self { limit, inserts, samples, live, drawn, batch_size } = *self;
        let counters = format!("inserts={inserts}, samples={samples}");
        let mut text = if live == 0 {
            format!(
                "the replay table holds no item to sample ({counters}, rate limiter {limiter}): \
                 {}",
                if inserts == 0 {
                    "nothing was inserted yet; is a producer running?"
                } else {
                    "every item inserted so far was removed (max_times_sampled) or evicted"
                }
            )
        } else {
            let mut text = format!("the rate limiter {limiter} holds sampling back ({counters}, ");
            let limiter = RateLimiter::new(limit);
            if live < limiter.min_size_to_sample {
                text += &format!(
                    "table size {live}): sampling starts once the table holds {} items",
                    limiter.min_size_to_sample
                );
            } else if let RateLimit::Queue(size) = limit {
                text += &format!(
                    "queue size {size}): every inserted item was sampled; each insert allows one \
                     more sample"
                );
            } else {
                let spi = limiter.samples_per_insert;
                #[allow(clippy::cast_precision_loss)] // counts far below 2^52 in any real run
                let diff = inserts as f64 * spi - samples as f64;
                text += &format!(
                    "table size {live}): inserts * samples_per_insert - samples = {diff:?} \
                     and a sample may not take it below min_diff = {:?}; each insert allows \
                     {spi:?} more samples",
                    limiter.min_diff
                );
            }
            text
        };
        if drawn > 0 {
            text += &format!(
                " ({drawn} of the batch's {batch_size} items are drawn and kept for the next call)"
            );
        }
        text
    }
}

/// What held a replay insert back when its deadline passed: the limiter and its counters,
/// read under the table's lock once the insert gave up. It tells a prefill that outran the
/// limiter (nothing samples, so nothing more may go in) from a table whose slots are all
/// being written.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InsertHoldback {
    /// The table's rate limiter.
    pub limit: RateLimit,
    /// Items ever inserted, as the limiter counts them (when their slot is reserved).
    pub inserts: u64,
    /// Items ever handed out, as the limiter counts them (a batch of `b` counts `b`).
    pub samples: u64,
    /// Items in the table as the limiter sees it (being written included).
    pub size: u64,
}

impl InsertHoldback {
    /// Whether the rate limiter holds inserts back now (rather than the table's slots).
    pub fn is_rate_limited(&self) -> bool {
        !RateLimiter::new(self.limit).with_counts(self.inserts, self.samples).can_insert(self.size)
    }

    /// One sentence for a timeout message, naming the limiter as `limiter` (its Python
    /// `repr`).
    pub fn explain(&self, limiter: &str) -> String {
        let Self { limit, inserts, samples, size } = *self;
        let counters = format!("inserts={inserts}, samples={samples}, table size {size}");
        if !self.is_rate_limited() {
            return format!(
                "the rate limiter {limiter} allows inserts ({counters}): the insert waited for \
                 a slot of the table (all of them being written) or for a restore's samples"
            );
        }
        let mut text = format!("the rate limiter {limiter} holds inserts back ({counters}): ");
        match limit {
            RateLimit::Queue(size) => {
                text += &format!(
                    "{size} items are inserted and not yet sampled, the most Queue(size) \
                     allows; each sampled item allows one more insert"
                );
            }
            RateLimit::MinSize(_) => text += "MinSize never holds inserts back",
            RateLimit::SampleToInsertRatio {
                samples_per_insert: spi,
                min_size_to_sample,
                min_diff,
                max_diff,
            } => {
                #[allow(clippy::cast_precision_loss)] // counts far below 2^52 in any real run
                let diff = inserts as f64 * spi - samples as f64;
                // A prefill that never samples: inserts go in while `inserts * spi + spi <=
                // max_diff` (or below min_size_to_sample), so it stops at this many.
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let prefill = ((max_diff / spi).floor().max(0.0) as u64).max(min_size_to_sample);
                let error_buffer = (max_diff - min_diff) / 2.0;
                text += &format!(
                    "inserts * samples_per_insert - samples = {diff:?} and an insert may not \
                     take it above max_diff = {max_diff:?}; each sampled item allows \
                     1 / samples_per_insert = {:?} more inserts. Until something samples, no \
                     insert goes in: a prefill that never calls sample() stops at {prefill} \
                     inserts (min_size_to_sample {min_size_to_sample} + error_buffer \
                     {error_buffer:?} / samples_per_insert {spi:?}); sample while you insert, \
                     or widen error_buffer",
                    1.0 / spi
                );
            }
        }
        text
    }
}

/// The limiter's state. Not synchronised: the table keeps it under its lock.
#[derive(Debug, Clone)]
pub(crate) struct RateLimiter {
    samples_per_insert: f64,
    min_size_to_sample: u64,
    min_diff: f64,
    max_diff: f64,
    inserts: u64,
    samples: u64,
}

impl RateLimiter {
    pub(crate) fn new(limit: RateLimit) -> Self {
        let (samples_per_insert, min_size_to_sample, min_diff, max_diff) = match limit {
            RateLimit::MinSize(n) => (1.0, n, f64::NEG_INFINITY, f64::INFINITY),
            RateLimit::SampleToInsertRatio {
                samples_per_insert,
                min_size_to_sample,
                min_diff,
                max_diff,
            } => (samples_per_insert, min_size_to_sample, min_diff, max_diff),
            #[allow(clippy::cast_precision_loss)] // queue sizes far below 2^52
            RateLimit::Queue(size) => (1.0, 1, 0.0, size as f64),
        };
        Self { samples_per_insert, min_size_to_sample, min_diff, max_diff, inserts: 0, samples: 0 }
    }

    /// This limiter with the counters `inserts` and `samples`.
    fn with_counts(mut self, inserts: u64, samples: u64) -> Self {
        self.set_counts(inserts, samples);
        self
    }

    #[allow(clippy::cast_precision_loss)] // counts far below 2^52 in any real run
    fn diff(&self) -> f64 {
        self.inserts as f64 * self.samples_per_insert - self.samples as f64
    }

    /// Whether one more insert may start, with `size` items in the table (pending included).
    pub(crate) fn can_insert(&self, size: u64) -> bool {
        size < self.min_size_to_sample || self.diff() + self.samples_per_insert <= self.max_diff
    }

    /// How many items may be sampled now, with `live` sampleable items in the table.
    pub(crate) fn allowed_samples(&self, live: u64) -> u64 {
        if live == 0 || live < self.min_size_to_sample {
            return 0;
        }
        let room = (self.diff() - self.min_diff).floor();
        // `as` saturates: +inf (MinSize) becomes u64::MAX, negatives and NaN become 0.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let allowed = room as u64;
        allowed
    }

    pub(crate) fn on_insert(&mut self) {
        self.inserts += 1;
    }

    pub(crate) fn on_sample(&mut self, n: u64) {
        self.samples += n;
    }

    /// `(inserts, samples)` so far.
    pub(crate) fn counts(&self) -> (u64, u64) {
        (self.inserts, self.samples)
    }

    /// Sets the counters (a restored checkpoint's).
    pub(crate) fn set_counts(&mut self, inserts: u64, samples: u64) {
        self.inserts = inserts;
        self.samples = samples;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn min_size_blocks_sampling_until_the_size_and_never_blocks_inserts() {
        let mut limiter = RateLimiter::new(RateLimit::MinSize(3));
        for size in 0..3 {
            assert_eq!(limiter.allowed_samples(size), 0);
            assert!(limiter.can_insert(size));
            limiter.on_insert();
        }
        assert_eq!(limiter.allowed_samples(3), u64::MAX);
        limiter.on_sample(1_000_000);
        assert!(limiter.can_insert(3));
        assert_eq!(limiter.allowed_samples(3), u64::MAX);
    }

    #[test]
    fn queue_allows_size_unsampled_items_and_samples_only_what_is_unsampled() {
        let mut limiter = RateLimiter::new(RateLimit::Queue(4));
        for size in 0..4 {
            assert!(limiter.can_insert(size));
            limiter.on_insert();
        }
        assert!(!limiter.can_insert(4), "the fifth unsampled item must wait");
        assert_eq!(limiter.allowed_samples(4), 4);
        limiter.on_sample(3);
        assert_eq!(limiter.allowed_samples(1), 1);
        assert!(limiter.can_insert(1));
    }

    #[test]
    fn ratio_keeps_the_diff_inside_the_window() {
        // Reverb's example numbers: 8 samples per insert, min size 10, error buffer 20.
        let limit = RateLimit::sample_to_insert_ratio(8.0, 10, 20.0);
        limit.validate(100).unwrap();
        let mut limiter = RateLimiter::new(limit);
        for size in 0..10 {
            assert_eq!(limiter.allowed_samples(size), 0);
            assert!(limiter.can_insert(size));
            limiter.on_insert();
        }
        // diff = 80, window [60, 100]: 20 samples allowed, 2 more inserts (80 + 8 + 8 <= 100).
        assert_eq!(limiter.allowed_samples(10), 20);
        assert!(limiter.can_insert(10));
        limiter.on_insert();
        limiter.on_insert();
        assert!(!limiter.can_insert(12), "diff 96 + 8 > 100");
        limiter.on_sample(36);
        assert_eq!(limiter.allowed_samples(12), 0, "diff 60 is the floor");
        assert!(limiter.can_insert(12));
    }

    #[test]
    fn inserts_are_allowed_below_min_size_even_past_the_window() {
        let mut limiter = RateLimiter::new(RateLimit::sample_to_insert_ratio(1.0, 5, 1.0));
        for _ in 0..100 {
            limiter.on_insert();
        }
        // Far past max_diff, but evictions left the table below min_size.
        assert!(limiter.can_insert(4));
        assert!(!limiter.can_insert(5));
    }

    #[test]
    fn validation_names_the_bad_parameter() {
        let err = |l: RateLimit| l.validate(1_000).unwrap_err().to_string();
        assert!(err(RateLimit::MinSize(0)).contains("min_size must be in 1..=max_size"));
        assert!(err(RateLimit::MinSize(1_001)).contains("got 1001"));
        assert!(err(RateLimit::Queue(0)).contains("size must be >= 1"));
        let msg = err(RateLimit::sample_to_insert_ratio(0.0, 10, 5.0));
        assert!(msg.contains("samples_per_insert must be a finite number > 0, got 0"), "{msg}");
        let msg = err(RateLimit::sample_to_insert_ratio(8.0, 10, 7.0));
        assert!(msg.contains("error_buffer >= 8"), "{msg}");
        let msg = err(RateLimit::sample_to_insert_ratio(1.0, 0, 7.0));
        assert!(msg.contains("min_size_to_sample must be in 1..=max_size"), "{msg}");
        let msg = err(RateLimit::sample_to_insert_ratio(1.0, 10, f64::NAN));
        assert!(msg.contains("error_buffer must be finite"), "{msg}");
    }

    #[test]
    fn a_limit_displays_as_python_spells_it() {
        assert_eq!(RateLimit::MinSize(1).to_string(), "MinSize(min_size=1)");
        assert_eq!(RateLimit::Queue(4).to_string(), "Queue(size=4)");
        assert_eq!(
            RateLimit::sample_to_insert_ratio(8.0, 10, 20.0).to_string(),
            "SampleToInsertRatio(samples_per_insert=8.0, min_size_to_sample=10, \
             error_buffer=(60.0, 100.0))"
        );
    }

    #[test]
    fn an_insert_holdback_names_the_limiter_and_where_a_prefill_stops() {
        let ratio = RateLimit::sample_to_insert_ratio(4.0, 100, 20.0);
        let held = InsertHoldback { limit: ratio, inserts: 105, samples: 0, size: 105 };
        assert!(held.is_rate_limited());
        assert_eq!(
            held.explain("R"),
            "the rate limiter R holds inserts back (inserts=105, samples=0, table size 105): \
             inserts * samples_per_insert - samples = 420.0 and an insert may not take it \
             above max_diff = 420.0; each sampled item allows 1 / samples_per_insert = 0.25 \
             more inserts. Until something samples, no insert goes in: a prefill that never \
             calls sample() stops at 105 inserts (min_size_to_sample 100 + error_buffer 20.0 / \
             samples_per_insert 4.0); sample while you insert, or widen error_buffer"
        );
        let below = InsertHoldback { limit: ratio, inserts: 104, samples: 0, size: 104 };
        assert!(!below.is_rate_limited(), "one more insert fits");
        assert!(below.explain("R").starts_with("the rate limiter R allows inserts"));
        let queue = InsertHoldback { limit: RateLimit::Queue(4), inserts: 12, samples: 8, size: 4 };
        assert_eq!(
            queue.explain("Queue(size=4)"),
            "the rate limiter Queue(size=4) holds inserts back (inserts=12, samples=8, table \
             size 4): 4 items are inserted and not yet sampled, the most Queue(size) allows; \
             each sampled item allows one more insert"
        );
    }

    #[test]
    fn a_holdback_says_whether_the_limiter_or_an_empty_table_holds_sampling() {
        let holdback = |limit, inserts, samples, live, drawn| SampleHoldback {
            limit,
            inserts,
            samples,
            live,
            drawn,
            batch_size: 8,
        };
        let empty = holdback(RateLimit::MinSize(1), 0, 0, 0, 0);
        assert!(!empty.is_rate_limited());
        assert_eq!(
            empty.explain("MinSize(min_size=1)"),
            "the replay table holds no item to sample (inserts=0, samples=0, rate limiter \
             MinSize(min_size=1)): nothing was inserted yet; is a producer running?"
        );
        let below = holdback(RateLimit::MinSize(100), 10, 0, 10, 0);
        assert!(below.is_rate_limited());
        assert_eq!(
            below.explain("MinSize(min_size=100)"),
            "the rate limiter MinSize(min_size=100) holds sampling back (inserts=10, samples=0, \
             table size 10): sampling starts once the table holds 100 items"
        );
        let queue = holdback(RateLimit::Queue(4), 12, 12, 4, 3);
        assert_eq!(
            queue.explain("Queue(size=4)"),
            "the rate limiter Queue(size=4) holds sampling back (inserts=12, samples=12, queue \
             size 4): every inserted item was sampled; each insert allows one more sample (3 of \
             the batch's 8 items are drawn and kept for the next call)"
        );
        let ratio = holdback(RateLimit::sample_to_insert_ratio(8.0, 10, 20.0), 12, 36, 12, 0);
        assert!(ratio.explain("R").ends_with(
            "(inserts=12, samples=36, table size 12): inserts * samples_per_insert - \
             samples = 60.0 and a sample may not take it below min_diff = 60.0; each insert \
             allows 8.0 more samples"
        ));
    }
}
