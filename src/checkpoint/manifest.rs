//! The checkpoint manifest (`manifest.json`): the one definition of every format version echo
//! has written, read and written here and nowhere else.
//!
//! | version | what it added                                                              |
//! |---------|----------------------------------------------------------------------------|
//! | 1       | replay tables: leaves, keys, priorities, times sampled, the table's state   |
//! | 2       | FIFO checkpoints; the ingress's acknowledged samples (`ingress`)           |
//! | 3       | sequence tables (`sequence.npy`, `counts.windows/open_episodes/chunks`)    |
//! | 4       | leaves stored compressed (`layout.leaves[i].codec` and `.lengths`)         |
//!
//! A checkpoint is written with the lowest version that describes it (4 only with compressed
//! leaf files, else 3), so that an older echo reads every checkpoint it could. `tuning` (the
//! settings that only tune: drainers, queue size, `compress`, `max_bytes`, the server's name)
//! may be absent, and a setting a newer echo added to it is ignored: the defaults are safe.
//! Every other field this version needs must be there and well formed, or
//! [`Manifest::parse`] refuses the manifest, naming the field.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::codec::Codec;
use crate::queued::SessionMark;
use crate::replay::{AtEnd, RateLimit, RemoverKind, SamplerKind, SequenceConfig};

/// The newest format version this echo reads, and the one it writes with compressed leaves.
pub const FORMAT_VERSION: u32 = 4;
/// The manifest's file name.
pub const MANIFEST: &str = "manifest.json";
/// The learner's `extra` tree's file name.
pub const EXTRA: &str = "extra.json";
/// A sequence table's metadata file name (the encoded [`crate::replay::SequenceSnapshot`]).
pub const SEQUENCE_META: &str = "sequence.npy";
/// A replay checkpoint's ingress samples' priorities (float64, NaN for none).
pub const INGRESS_PRIORITIES: &str = "ingress_priorities.npy";
/// A replay checkpoint's per-item files, in the order the table's items list them.
pub const META_FILES: [&str; 3] = ["keys.npy", "priorities.npy", "times_sampled.npy"];

/// Which backend a checkpoint holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    /// A replay table.
    #[serde(rename = "echo-replay-checkpoint")]
    Replay,
    /// The FIFO ring.
    #[serde(rename = "echo-fifo-checkpoint")]
    Fifo,
    /// A sequence table.
    #[serde(rename = "echo-sequence-checkpoint")]
    Sequence,
}

impl Kind {
    /// The manifest's `format` string.
    pub fn format(self) -> &'static str {
        match self {
            Self::Replay => "echo-replay-checkpoint",
            Self::Fifo => "echo-fifo-checkpoint",
            Self::Sequence => "echo-sequence-checkpoint",
        }
    }

    /// `a replay table`, for messages.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Replay => "a replay table",
            Self::Fifo => "a FIFO ring",
            Self::Sequence => "a sequence table",
        }
    }

    /// `replay`, `fifo` or `sequence`: what the bindings call it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Replay => "replay",
            Self::Fifo => "fifo",
            Self::Sequence => "sequence",
        }
    }
}

/// A file's size and SHA-256, as the manifest lists every file but itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Lower-case hex SHA-256 of the whole file.
    pub sha256: String,
    /// The file's size in bytes.
    pub bytes: u64,
}

impl FileEntry {
    /// The entry of a file of `bytes` bytes whose SHA-256 is `digest`.
    pub fn new(digest: &[u8; 32], bytes: u64) -> Self {
        Self { sha256: hex(digest), bytes }
    }
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// A codec as the manifest spells it: `["zstd", level]` or `["lz4", 0]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodecEntry(pub Codec);

impl Serialize for CodecEntry {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        (self.0.name(), self.0.level()).serialize(s)
    }
}

impl<'de> Deserialize<'de> for CodecEntry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let (name, level) = <(String, i32)>::deserialize(d)?;
        // The level was accepted for its leaf when the checkpoint was written; only the
        // codec's own range is checked again.
        Codec::from_name(&name, level).map(Self).map_err(serde::de::Error::custom)
    }
}

/// One leaf of the layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeafEntry {
    /// Its path in the example's tree as Python prints it (`['obs']`).
    pub name: String,
    /// The keys and indices leading to it (JSON values: str keys, int indices).
    pub path: Vec<Value>,
    /// numpy's `dtype_to_descr` of its dtype: a string (`"<f4"`), or a list for a structured
    /// dtype.
    pub dtype: Value,
    /// One sample's shape.
    pub shape: Vec<usize>,
    /// The file of its rows (`leaf_000.npy`, or `leaf_000.zst` compressed).
    pub file: String,
    /// How its rows are compressed in `file` (format 4); absent: an `.npy` of raw rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub codec: Option<CodecEntry>,
    /// With `codec`: the `.npy` (uint32) of each compressed row's length.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lengths: Option<String>,
}

/// The layout: the example's structure and its leaves in flattened order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Layout {
    /// The tree's structure as optree prints it.
    pub treespec: String,
    /// The leaves.
    pub leaves: Vec<LeafEntry>,
}

/// A sampler, remover, rate limiter or sequence setting, tagged with its `echo.replay` class
/// name and holding that dataclass's fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum Strategy {
    /// `Fifo()` (a remover).
    Fifo {},
    /// `Lifo()` (a sampler or remover).
    Lifo {},
    /// `Uniform()`.
    Uniform {},
    /// `Prioritized(exponent)`.
    Prioritized {
        /// The priority exponent.
        exponent: f64,
    },
    /// `MinPriority()` (a remover).
    MinPriority {},
    /// `MinSize(min_size)`.
    MinSize {
        /// Items before the first sample.
        min_size: u64,
    },
    /// `SampleToInsertRatio(...)`, its window as `error_buffer`.
    SampleToInsertRatio {
        /// Target samples per insert.
        samples_per_insert: f64,
        /// Items before the first sample.
        min_size_to_sample: u64,
        /// The window `(min_diff, max_diff)`.
        error_buffer: (f64, f64),
    },
    /// `Queue(size)`.
    Queue {
        /// Unsampled items at most.
        size: u64,
    },
    /// `Sequence(length, period, at_end, max_streams)`.
    Sequence {
        /// Steps per window.
        length: usize,
        /// Steps between window starts.
        period: usize,
        /// `pad`, `shift` or `drop`.
        at_end: String,
        /// Streams per producer.
        max_streams: usize,
    },
}

impl Strategy {
    /// The class name (`Uniform`).
    pub fn class(&self) -> &'static str {
        match self {
            Self::Fifo {} => "Fifo",
            Self::Lifo {} => "Lifo",
            Self::Uniform {} => "Uniform",
            Self::Prioritized { .. } => "Prioritized",
            Self::MinPriority {} => "MinPriority",
            Self::MinSize { .. } => "MinSize",
            Self::SampleToInsertRatio { .. } => "SampleToInsertRatio",
            Self::Queue { .. } => "Queue",
            Self::Sequence { .. } => "Sequence",
        }
    }

    /// A sampler.
    pub fn sampler(kind: SamplerKind) -> Self {
        match kind {
            SamplerKind::Uniform => Self::Uniform {},
            SamplerKind::Prioritized { exponent } => Self::Prioritized { exponent },
            SamplerKind::Lifo => Self::Lifo {},
        }
    }

    /// A remover.
    pub fn remover(kind: RemoverKind) -> Self {
        match kind {
            RemoverKind::Fifo => Self::Fifo {},
            RemoverKind::Lifo => Self::Lifo {},
            RemoverKind::MinPriority => Self::MinPriority {},
        }
    }

    /// A rate limiter.
    pub fn rate_limiter(limit: RateLimit) -> Self {
        match limit {
            RateLimit::MinSize(min_size) => Self::MinSize { min_size },
            RateLimit::Queue(size) => Self::Queue { size },
            RateLimit::SampleToInsertRatio {
                samples_per_insert,
                min_size_to_sample,
                min_diff,
                max_diff,
            } => Self::SampleToInsertRatio {
                samples_per_insert,
                min_size_to_sample,
                error_buffer: (min_diff, max_diff),
            },
        }
    }

    /// A sequence table's windows.
    pub fn sequence(config: &SequenceConfig) -> Self {
        Self::Sequence {
            length: config.length,
            period: config.period,
            at_end: config.at_end.name().to_owned(),
            max_streams: config.max_streams,
        }
    }

    /// The sequence setting back, `None` for another strategy or an unknown `at_end`.
    pub fn to_sequence(&self) -> Option<SequenceConfig> {
        let Self::Sequence { length, period, at_end, max_streams } = self else { return None };
        let at_end = match at_end.as_str() {
            "pad" => AtEnd::Pad,
            "shift" => AtEnd::Shift,
            "drop" => AtEnd::Drop,
            _ => return None,
        };
        Some(SequenceConfig { length: *length, period: *period, at_end, max_streams: *max_streams })
    }
}

/// The settings that are part of the data: a restore keeps them. A FIFO ring's are
/// `batch_size` and `num_buffers`; a replay or sequence table's the rest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    /// Samples per batch.
    pub batch_size: usize,
    /// FIFO: the ring's batches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_buffers: Option<usize>,
    /// Replay: items (sequence: steps) the table holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_size: Option<usize>,
    /// Replay: the sampler.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampler: Option<Strategy>,
    /// Replay: the remover.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remover: Option<Strategy>,
    /// Replay: the rate limiter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limiter: Option<Strategy>,
    /// Replay: samples after which an item is removed (0: never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_times_sampled: Option<u32>,
    /// Sequence tables: the windows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence: Option<Strategy>,
}

impl Settings {
    /// Batches of `batch_size`, every other setting absent (the caller fills its kind's).
    pub fn new(batch_size: usize) -> Self {
        Self {
            batch_size,
            num_buffers: None,
            max_size: None,
            sampler: None,
            remover: None,
            rate_limiter: None,
            max_times_sampled: None,
            sequence: None,
        }
    }
}

/// The settings that only tune the server; a restore keeps them unless given others.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Tuning {
    /// The ingress's drainer threads (>= 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_drainers: Option<usize>,
    /// Each connection's queue, as the server was given it: absent when not recorded,
    /// `Some(None)` for the automatic size.
    #[serde(default, deserialize_with = "present", skip_serializing_if = "Option::is_none")]
    pub producer_queue_size: Option<Option<usize>>,
    /// Per leaf, how the table stores it (`null`: raw); absent when no leaf is compressed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compress: Option<Vec<Option<CodecEntry>>>,
    /// The table's byte bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
    /// The server's name (the `server` label of its metrics), non-empty; absent in
    /// checkpoints written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The staleness bound of a server whose samples carry policy versions (its example's
    /// last leaf is the version leaf); absent without a bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_staleness: Option<u64>,
    /// What that server did with stale samples: `"drop"` or `"block"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<String>,
}

/// A field that may be `null` when present: `Some(None)` then, `None` only when absent.
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// How many rows the data files hold, and where they came from.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Counts {
    /// Rows in each leaf file (items, steps, or the FIFO ring's samples then the ingress's).
    pub items: u64,
    /// FIFO: rows from the ring.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_ring: Option<u64>,
    /// Rows of acknowledged samples the ingress held (format 2 on; 0 when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_ingress: Option<u64>,
    /// FIFO: samples handed out before the checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handed_out_before: Option<u64>,
    /// Sequence: windows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub windows: Option<u64>,
    /// Sequence: episodes still open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open_episodes: Option<u64>,
    /// Sequence: chunks of consecutive steps (one compressed row each).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunks: Option<u64>,
}

/// A replay table's state beside its items.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TableStateEntry {
    /// Inserts the rate limiter counted.
    pub inserts: u64,
    /// Samples the rate limiter counted.
    pub samples: u64,
    /// The sampler's RNG state.
    pub rng: [u64; 4],
    /// The next item's key.
    pub next_key: u64,
    /// The largest priority seen.
    pub max_priority: f64,
}

/// Where the ingress's acknowledged samples are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IngressFiles {
    /// One file per leaf (`ingress_leaf_000.npy`, ...).
    pub files: Vec<String>,
    /// A replay checkpoint's: their priorities (float64, NaN for none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priorities: Option<String>,
}

/// A checkpoint's manifest, every version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// The backend.
    pub format: Kind,
    /// The format version (see the module's table).
    pub format_version: u32,
    /// The echo that wrote it.
    #[serde(default)]
    pub echo_version: String,
    /// When it was written.
    #[serde(default)]
    pub created_unix_ns: u64,
    /// The settings that are part of the data.
    pub settings: Settings,
    /// The settings that only tune.
    #[serde(default)]
    pub tuning: Tuning,
    /// The example's layout.
    pub layout: Layout,
    /// The row counts.
    pub counts: Counts,
    /// A replay table's state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<TableStateEntry>,
    /// A sequence table's metadata file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence: Option<String>,
    /// The ingress's samples, when there were some.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ingress: Option<IngressFiles>,
    /// The learner's `extra` tree's file, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra: Option<String>,
    /// Every other file: its size and SHA-256.
    pub files: BTreeMap<String, FileEntry>,
    /// How far each durable session's samples reach in it (what a restored server tells
    /// those clients to resend from); none without durable clients. An older echo ignores it
    /// (its restored sessions are then new ones).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sessions: Vec<SessionEntry>,
}

/// A durable session's mark ([`crate::queued::SessionMark`]) as the manifest spells it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionEntry {
    /// The session id, 32 lowercase hex digits.
    pub id: String,
    /// The sequence number of its first sample the checkpoint does not hold.
    pub seq: u64,
}

impl SessionEntry {
    /// The entry of `mark`.
    pub fn new(mark: &SessionMark) -> Self {
        Self { id: hex(&mark.id), seq: mark.seq }
    }

    /// The mark it spells; `None` for an id that is not 32 hex digits.
    pub fn mark(&self) -> Option<SessionMark> {
        let digits = self.id.as_bytes();
        if digits.len() != 32 {
            return None;
        }
        let mut id = [0u8; 16];
        for (byte, pair) in id.iter_mut().zip(digits.chunks_exact(2)) {
            let text = std::str::from_utf8(pair).ok()?;
            *byte = u8::from_str_radix(text, 16).ok()?;
        }
        Some(SessionMark { id, seq: self.seq })
    }
}

/// What is wrong with a manifest, without the file's name (the caller adds it).
pub type Refusal = String;

impl Manifest {
    /// Reads and checks a manifest: its format and version first (so that a newer echo's
    /// says so), then every field this version needs, then what the fields say together
    /// (see [`Manifest::check`]). The message says what is wrong, for the caller to prefix
    /// with the file's path.
    ///
    /// # Errors
    /// The [`Refusal`].
    pub fn parse(bytes: &[u8]) -> Result<Self, Refusal> {
        let value: Value =
            serde_json::from_slice(bytes).map_err(|e| format!("not valid JSON ({e})"))?;
        let Value::Object(object) = &value else {
            return Err("not a checkpoint manifest (a JSON object)".into());
        };
        let format = object.get("format");
        let kind = format.and_then(|f| Kind::deserialize(f).ok());
        let version = object.get("format_version").and_then(Value::as_u64);
        let (Some(kind), Some(version)) = (kind, version) else {
            let shown = format.map_or_else(|| "None".to_owned(), Value::to_string);
            return Err(format!(
                "not an echo checkpoint manifest (format {shown}, expected \
                 \"echo-replay-checkpoint\", \"echo-fifo-checkpoint\" or \
                 \"echo-sequence-checkpoint\")"
            ));
        };
        if kind == Kind::Fifo && version < 2 {
            return Err(format!("a FIFO checkpoint needs format version 2, got {version}"));
        }
        if kind == Kind::Sequence && version < 3 {
            return Err(format!("a sequence checkpoint needs format version 3, got {version}"));
        }
        if version > u64::from(FORMAT_VERSION) {
            return Err(format!(
                "format version {version} is newer than this echo ({}) reads (up to \
                 {FORMAT_VERSION}); upgrade echo to restore it",
                env!("CARGO_PKG_VERSION")
            ));
        }
        let manifest = Self::deserialize(&value).map_err(|e| format!("malformed ({e})"))?;
        manifest.check().map_err(|e| format!("malformed ({e})"))?;
        Ok(manifest)
    }

    /// What the fields must say together: the fields this kind needs, the counts adding up,
    /// one ingress file per leaf, compressed leaves only where this version has them, every
    /// file this manifest names listed with a checksum, and every listed name a plain file
    /// name.
    ///
    /// # Errors
    /// What is wrong.
    pub fn check(&self) -> Result<(), String> {
        let s = &self.settings;
        let c = &self.counts;
        let leaves = self.layout.leaves.len();
        match self.format {
            Kind::Fifo => {
                need(s.num_buffers, "settings.num_buffers")?;
                let from_ring = need(c.from_ring, "counts.from_ring")?;
                let from_ingress = c.from_ingress.unwrap_or(0);
                if from_ring.checked_add(from_ingress) != Some(c.items) {
                    return Err(format!(
                        "counts: from_ring {from_ring} + from_ingress {from_ingress} != items {}",
                        c.items
                    ));
                }
                if self.layout.leaves.iter().any(|l| l.codec.is_some()) {
                    return Err("compressed leaf files in a FIFO checkpoint".into());
                }
            }
            Kind::Replay | Kind::Sequence => {
                need(s.max_size, "settings.max_size")?;
                need(s.sampler.as_ref(), "settings.sampler")?;
                need(s.remover.as_ref(), "settings.remover")?;
                need(s.rate_limiter.as_ref(), "settings.rate_limiter")?;
                need(s.max_times_sampled, "settings.max_times_sampled")?;
                if self.format == Kind::Replay {
                    need(self.state.as_ref(), "state")?;
                } else {
                    let sequence = need(s.sequence.as_ref(), "settings.sequence")?;
                    if sequence.to_sequence().is_none() {
                        return Err(format!("settings.sequence: not a Sequence ({sequence:?})"));
                    }
                    need(self.sequence.as_ref(), "sequence")?;
                    if self.layout.leaves.iter().any(|l| l.codec.is_some()) {
                        need(c.chunks, "counts.chunks")?;
                    }
                }
            }
        }
        let t = &self.tuning;
        for (name, value) in [
            ("num_drainers", t.num_drainers.map(|n| n as u64)),
            ("producer_queue_size", t.producer_queue_size.flatten().map(|n| n as u64)),
            ("max_bytes", t.max_bytes),
        ] {
            if value == Some(0) {
                return Err(format!("tuning: {name} must be an int >= 1, got 0"));
            }
        }
        if t.name.as_deref() == Some("") {
            return Err("tuning: name must be a non-empty string, got \"\"".into());
        }
        if let Some(compress) = &t.compress {
            if compress.len() != leaves {
                return Err(format!(
                    "tuning: compress has {} entries, the layout {leaves} leaves",
                    compress.len()
                ));
            }
        }
        if self.format_version < 4 && self.layout.leaves.iter().any(|l| l.codec.is_some()) {
            return Err(format!(
                "compressed leaf files need format version 4, got {}",
                self.format_version
            ));
        }
        for leaf in &self.layout.leaves {
            if leaf.codec.is_some() != leaf.lengths.is_some() {
                return Err(format!(
                    "layout: leaf {} has a codec or lengths file alone",
                    leaf.name
                ));
            }
        }
        if c.from_ingress.unwrap_or(0) > 0 && self.format != Kind::Fifo {
            let ingress = need(self.ingress.as_ref(), "ingress")?;
            if ingress.files.len() != leaves {
                return Err(format!("ingress: {} files for {leaves} leaves", ingress.files.len()));
            }
            if self.format == Kind::Replay {
                need(ingress.priorities.as_ref(), "ingress.priorities")?;
            }
        }
        for name in self.files.keys() {
            if !is_plain_name(name) {
                return Err(format!("file name {name:?} is not a plain name"));
            }
        }
        if let Some(extra) = &self.extra {
            if extra != EXTRA {
                return Err(format!("extra names {extra:?}, expected {EXTRA:?}"));
            }
        }
        for name in self.data_files() {
            if !self.files.contains_key(name) {
                return Err(format!("lists no checksum for {name}"));
            }
        }
        Ok(())
    }

    /// Every file the data needs (not the extra's), as the manifest names them.
    pub fn data_files(&self) -> Vec<&str> {
        let mut names: Vec<&str> = Vec::new();
        for leaf in &self.layout.leaves {
            names.push(&leaf.file);
            names.extend(leaf.lengths.as_deref());
        }
        match self.format {
            Kind::Replay => names.extend(META_FILES),
            Kind::Sequence => names.extend(self.sequence.as_deref()),
            Kind::Fifo => {}
        }
        if self.from_ingress() > 0 {
            if let Some(ingress) = &self.ingress {
                names.extend(ingress.files.iter().map(String::as_str));
                names.extend(ingress.priorities.as_deref());
            }
        }
        names.extend(self.extra.as_deref());
        names
    }

    /// Rows of the ingress's samples (0 before format 2 and when there were none).
    pub fn from_ingress(&self) -> u64 {
        self.counts.from_ingress.unwrap_or(0)
    }

    /// The manifest as written: indented JSON.
    pub fn to_json(&self) -> Vec<u8> {
        let mut out = serde_json::to_vec_pretty(self).unwrap_or_default();
        out.push(b'\n');
        out
    }
}

/// `value`, or a message that `field` is missing.
fn need<T>(value: Option<T>, field: &str) -> Result<T, String> {
    value.ok_or_else(|| format!("missing {field}"))
}

/// A name with no directory part that names a file in the directory itself.
pub fn is_plain_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains('/') && !name.contains('\0')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fifo() -> Manifest {
        Manifest {
            format: Kind::Fifo,
            format_version: 3,
            echo_version: "0".into(),
            created_unix_ns: 1,
            settings: Settings { num_buffers: Some(4), ..Settings::new(2) },
            tuning: Tuning::default(),
            layout: Layout {
                treespec: "PyTreeSpec(*)".into(),
                leaves: vec![LeafEntry {
                    name: "".into(),
                    path: vec![],
                    dtype: Value::String("<f4".into()),
                    shape: vec![3],
                    file: "leaf_000.npy".into(),
                    codec: None,
                    lengths: None,
                }],
            },
            counts: Counts {
                items: 5,
                from_ring: Some(5),
                from_ingress: Some(0),
                ..Counts::default()
            },
            state: None,
            sequence: None,
            ingress: None,
            extra: None,
            files: BTreeMap::from([(
                "leaf_000.npy".to_owned(),
                FileEntry { sha256: "00".into(), bytes: 1 },
            )]),
            sessions: Vec::new(),
        }
    }

    #[test]
    fn a_written_manifest_reads_back_the_same() {
        let m = fifo();
        assert_eq!(Manifest::parse(&m.to_json()).unwrap(), m);
    }

    #[test]
    fn counts_that_do_not_add_up_are_refused_naming_the_field() {
        let mut m = fifo();
        m.counts.from_ring = Some(6);
        let e = Manifest::parse(&m.to_json()).unwrap_err();
        assert!(e.contains("from_ring 6 + from_ingress 0 != items 5"), "{e}");
    }

    #[test]
    fn a_newer_version_and_a_foreign_format_are_named() {
        let mut m = fifo();
        m.format_version = FORMAT_VERSION + 1;
        let e = Manifest::parse(&m.to_json()).unwrap_err();
        assert!(e.starts_with(&format!("format version {} is newer", FORMAT_VERSION + 1)), "{e}");
        let e = Manifest::parse(br#"{"format": "zip", "format_version": 1}"#).unwrap_err();
        assert!(e.contains("not an echo checkpoint manifest (format \"zip\""), "{e}");
        assert!(Manifest::parse(b"[1]").unwrap_err().contains("a JSON object"));
        assert!(Manifest::parse(b"{").unwrap_err().starts_with("not valid JSON"));
    }

    #[test]
    fn file_names_with_a_directory_part_are_refused() {
        let mut m = fifo();
        m.files.insert("../x".into(), FileEntry { sha256: "00".into(), bytes: 1 });
        let e = Manifest::parse(&m.to_json()).unwrap_err();
        assert!(e.contains("\"../x\" is not a plain name"), "{e}");
    }

    #[test]
    fn a_data_file_without_a_checksum_is_refused() {
        let mut m = fifo();
        m.files.clear();
        let e = Manifest::parse(&m.to_json()).unwrap_err();
        assert!(e.contains("lists no checksum for leaf_000.npy"), "{e}");
    }

    #[test]
    fn tuning_tells_an_automatic_queue_size_from_an_unrecorded_one() {
        let t: Tuning = serde_json::from_str(r#"{"producer_queue_size": null}"#).unwrap();
        assert_eq!(t.producer_queue_size, Some(None));
        let t: Tuning = serde_json::from_str(r#"{"newer_setting": 1}"#).unwrap();
        assert_eq!(t.producer_queue_size, None);
        let t: Tuning = serde_json::from_str(r#"{"compress": [null, ["lz4", 0]]}"#).unwrap();
        assert_eq!(t.compress, Some(vec![None, Some(CodecEntry(Codec::Lz4))]));
        assert!(serde_json::from_str::<Tuning>(r#"{"compress": [["zstd", 99]]}"#).is_err());
    }

    #[test]
    fn tuning_name_is_read_back_and_an_empty_one_is_refused() {
        let t: Tuning = serde_json::from_str(r#"{"name": "learner-0"}"#).unwrap();
        assert_eq!(t.name.as_deref(), Some("learner-0"));
        assert_eq!(serde_json::from_str::<Tuning>("{}").unwrap().name, None);
        let mut m = fifo();
        m.tuning.name = Some(String::new());
        let e = Manifest::parse(&m.to_json()).unwrap_err();
        assert!(e.contains("tuning: name must be a non-empty string"), "{e}");
    }
}
