//! Reading a checkpoint: the manifest parsed and checked, every file it lists opened, checked
//! (size, SHA-256) and mapped before anything is loaded, the example compared with the
//! layout, then the data restored into a new backend of the checkpoint's kind.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::manifest::{Kind, Manifest, EXTRA, MANIFEST, META_FILES};
use super::mapped::{read_small, MappedFile};
use super::npy::{native_descr, NpyHeader};
use super::Example;
use crate::backend::{Backend, Restore};
use crate::error::EchoError;
use crate::queued::QueuedSamples;
use crate::replay::{LeafRows, SequenceSnapshot, SnapshotItems, TableState};
use crate::source::Rows;

/// The largest manifest a restore reads: far above a real one (a few hundred bytes per leaf
/// and per file), so a tampered one cannot make it read or allocate without bound.
const MANIFEST_MAX_BYTES: u64 = 64 << 20;

/// Which of a checkpoint's files [`OpenedCheckpoint::open`] checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verify {
    /// Every file: before a restore.
    All,
    /// Only the learner's `extra` (`read_extra`).
    ExtraOnly,
}

/// A checkpoint whose manifest and files are checked, its files mapped.
#[derive(Debug)]
pub struct OpenedCheckpoint {
    root: PathBuf,
    manifest: Manifest,
    files: BTreeMap<String, MappedFile>,
}

/// `root/file: what`, a [`EchoError::Checkpoint`].
fn refused(root: &Path, file: &str, what: impl std::fmt::Display) -> EchoError {
    EchoError::Checkpoint(format!("{}: {what}", root.join(file).display()))
}

impl OpenedCheckpoint {
    /// Opens the checkpoint at `path` (its link is resolved once, so a periodic checkpoint
    /// replacing it meanwhile does not mix two), parses its manifest and checks the files
    /// `verify` says (a link is not followed; a file must be regular and of the listed size).
    ///
    /// # Errors
    /// [`EchoError::Checkpoint`] naming the file and what is wrong with it.
    pub fn open(path: &Path, verify: Verify) -> Result<Self, EchoError> {
        let root = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        let bytes = read_small(&root, MANIFEST, MANIFEST_MAX_BYTES).map_err(|e| {
            let e = if e == "missing" {
                "missing (not a checkpoint, or an incomplete one)"
            } else {
                &e
            };
            refused(&root, MANIFEST, e)
        })?;
        let manifest = Manifest::parse(&bytes).map_err(|e| refused(&root, MANIFEST, e))?;
        let mut files = BTreeMap::new();
        for (name, entry) in &manifest.files {
            let wanted = match verify {
                Verify::All => true,
                Verify::ExtraOnly => name == EXTRA || name.starts_with("extra_"),
            };
            if wanted {
                let mapped = MappedFile::open_checked(&root, name, entry)
                    .map_err(|e| refused(&root, name, e))?;
                files.insert(name.clone(), mapped);
            }
        }
        Ok(Self { root, manifest, files })
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The directory, its link resolved.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// A checked file's bytes (`None` if the manifest does not list it or it was not checked).
    pub fn file(&self, name: &str) -> Option<&[u8]> {
        self.files.get(name).map(MappedFile::bytes)
    }

    fn manifest_error(&self, what: impl std::fmt::Display) -> EchoError {
        refused(&self.root, MANIFEST, what)
    }

    /// Compares `example` (the one a restore will build the server from) with the layout:
    /// the leaf count, each leaf's name, dtype and shape, then the tree's structure.
    ///
    /// # Errors
    /// [`EchoError::Checkpoint`] saying what differs.
    pub fn check_example(&self, example: &Example) -> Result<(), EchoError> {
        let layout = &self.manifest.layout;
        if example.leaves.len() != layout.leaves.len() {
            return Err(self.manifest_error(format!(
                "the example has {} leaves, the checkpoint {} ({})",
                example.leaves.len(),
                layout.leaves.len(),
                layout.treespec
            )));
        }
        for (mine, theirs) in example.leaves.iter().zip(&layout.leaves) {
            if mine.name != theirs.name || mine.dtype != theirs.dtype || mine.shape != theirs.shape
            {
                return Err(self.manifest_error(format!(
                    "the example's leaf {} ({}{:?}) does not match the checkpoint's {} ({}{:?}, \
                     {})",
                    mine.name,
                    mine.dtype,
                    mine.shape,
                    theirs.name,
                    theirs.dtype,
                    theirs.shape,
                    theirs.file
                )));
            }
        }
        if example.treespec != layout.treespec {
            return Err(self.manifest_error(format!(
                "the example's structure {} differs from the checkpoint's {}",
                example.treespec, layout.treespec
            )));
        }
        Ok(())
    }

    /// The leaf paths as str keys, for an example of nested dicts.
    ///
    /// # Errors
    /// [`EchoError::Checkpoint`] if a leaf is not in a tree of dicts with str keys (then the
    /// caller must be given the example).
    pub fn dict_paths(&self) -> Result<Vec<Vec<&str>>, EchoError> {
        self.manifest
            .layout
            .leaves
            .iter()
            .map(|leaf| {
                let keys: Option<Vec<&str>> = leaf.path.iter().map(Value::as_str).collect();
                keys.filter(|k| !k.is_empty()).ok_or_else(|| {
                    self.manifest_error(format!(
                        "leaf {} is not in a tree of dicts with str keys; pass example= to \
                         restore it",
                        leaf.name
                    ))
                })
            })
            .collect()
    }

    /// A data file's rows: `n` of leaf shape `shape` at `item_bytes` per element, dtype `descr`.
    fn npy(
        &self,
        name: &str,
        descr: &str,
        n: u64,
        shape: &[usize],
        item_bytes: usize,
    ) -> Result<&[u8], EchoError> {
        let bytes = self
            .file(name)
            .ok_or_else(|| self.manifest_error(format!("lists no checksum for {name}")))?;
        let n = usize::try_from(n).map_err(|_| refused(&self.root, name, "too many rows"))?;
        let full: Vec<usize> = std::iter::once(n).chain(shape.iter().copied()).collect();
        NpyHeader::data(bytes, descr, &full, item_bytes).map_err(|e| refused(&self.root, name, e))
    }

    /// A 1-D file of `n` native numbers of numpy kind `kind` (`u`, `f`) and `size` bytes.
    fn numbers<T>(
        &self,
        name: &str,
        kind: char,
        n: u64,
        from: fn(&[u8]) -> T,
    ) -> Result<Vec<T>, EchoError> {
        let size = std::mem::size_of::<T>();
        let bytes = self.npy(name, &native_descr(kind, size), n, &[], size)?;
        Ok(bytes.chunks_exact(size).map(from).collect())
    }

    /// Restores the checkpoint's data into `backend`, a new one built from its settings and
    /// example; `npy_descrs[l]` is leaf `l`'s dtype as its `.npy` header spells it.
    ///
    /// # Errors
    /// [`EchoError::Checkpoint`] naming the file or what does not fit; nothing is inserted
    /// then.
    pub fn restore_into(&self, backend: &Backend, npy_descrs: &[String]) -> Result<(), EchoError> {
        let m = &self.manifest;
        let spec = backend.spec();
        let arrays = spec.arrays();
        if arrays.len() != m.layout.leaves.len() || npy_descrs.len() != arrays.len() {
            return Err(self.manifest_error(format!(
                "the server has {} leaves, the checkpoint {}",
                arrays.len(),
                m.layout.leaves.len()
            )));
        }
        let n = m.counts.items;
        let packed_rows = if m.format == Kind::Sequence { m.counts.chunks.unwrap_or(0) } else { n };
        let mut lengths: Vec<Option<Vec<u32>>> = Vec::with_capacity(arrays.len());
        for leaf in &m.layout.leaves {
            lengths.push(match &leaf.lengths {
                Some(file) => Some(self.numbers(file, 'u', packed_rows, |b| {
                    u32::from_ne_bytes(b.try_into().expect("chunks of 4"))
                })?),
                None => None,
            });
        }
        let mut leaves = Vec::with_capacity(arrays.len());
        for (((leaf, array), descr), lengths) in
            m.layout.leaves.iter().zip(arrays).zip(npy_descrs).zip(&lengths)
        {
            leaves.push(match (&leaf.codec, lengths) {
                (Some(codec), Some(lengths)) => {
                    let bytes = self.file(&leaf.file).unwrap_or_default();
                    LeafRows::Packed { codec: codec.0, bytes, lengths }
                }
                _ => LeafRows::Raw(self.npy(
                    &leaf.file,
                    descr,
                    n,
                    array.shape(),
                    array.dtype_size(),
                )?),
            });
        }
        let from_ingress = m.from_ingress();
        let ingress_leaves = match (&m.ingress, from_ingress) {
            (Some(ingress), 1..) if m.format != Kind::Fifo => ingress
                .files
                .iter()
                .zip(arrays)
                .zip(npy_descrs)
                .map(|((file, array), descr)| {
                    self.npy(file, descr, from_ingress, array.shape(), array.dtype_size())
                })
                .collect::<Result<Vec<_>, _>>()?,
            _ => arrays.iter().map(|_| &[][..]).collect(),
        };
        let restore = match m.format {
            Kind::Fifo => {
                let raw: Vec<&[u8]> = leaves
                    .iter()
                    .map(|l| match l {
                        LeafRows::Raw(b) => *b,
                        LeafRows::Packed { bytes, .. } => bytes,
                    })
                    .collect();
                let n = usize::try_from(n).unwrap_or(usize::MAX);
                return backend
                    .restore(Restore::Fifo { leaves: &raw, n })
                    .map(drop)
                    .map_err(|e| self.restore_error(e));
            }
            Kind::Sequence => {
                let name = m.sequence.as_deref().unwrap_or_default();
                let (descr, len) = self.meta_header(name)?;
                let meta = self.npy(name, &descr, len, &[], 1)?;
                let snapshot = SequenceSnapshot::decode(meta).map_err(|e| self.restore_error(e))?;
                return backend
                    .restore(Restore::Sequence {
                        snapshot: &snapshot,
                        leaves: &leaves,
                        queued_leaves: &ingress_leaves,
                    })
                    .map(drop)
                    .map_err(|e| self.restore_error(e));
            }
            Kind::Replay => {
                let u64s = |b: &[u8]| u64::from_ne_bytes(b.try_into().expect("chunks of 8"));
                let f64s = |b: &[u8]| f64::from_ne_bytes(b.try_into().expect("chunks of 8"));
                let items = SnapshotItems {
                    keys: self.numbers(META_FILES[0], 'u', n, u64s)?,
                    priorities: self.numbers(META_FILES[1], 'f', n, f64s)?,
                    times_sampled: self.numbers(META_FILES[2], 'u', n, |b| {
                        u32::from_ne_bytes(b.try_into().expect("chunks of 4"))
                    })?,
                };
                let s = m
                    .state
                    .as_ref()
                    .ok_or_else(|| self.manifest_error("malformed (missing state)"))?;
                let state = TableState {
                    inserts: s.inserts,
                    samples: s.samples,
                    rng: s.rng,
                    next_key: s.next_key,
                    max_priority: s.max_priority,
                };
                let priorities = match m.ingress.as_ref().and_then(|i| i.priorities.as_deref()) {
                    Some(name) if from_ingress > 0 => {
                        self.numbers(name, 'f', from_ingress, f64s)?
                    }
                    _ => Vec::new(),
                };
                let queued = self.queued(backend, &ingress_leaves, &priorities)?;
                (items, state, queued)
            }
        };
        let (items, state, queued) = restore;
        backend
            .restore(Restore::Replay { items: &items, state: &state, leaves: &leaves, queued })
            .map(drop)
            .map_err(|e| self.restore_error(e))
    }

    /// A sequence metadata file's dtype (`'<u1'` as written, or numpy's `'|u1'`) and length
    /// (its header says; the data is checked against them on load).
    fn meta_header(&self, name: &str) -> Result<(String, u64), EchoError> {
        let bytes = self.file(name).unwrap_or_default();
        let header = NpyHeader::parse(bytes).map_err(|e| refused(&self.root, name, e))?;
        let native = native_descr('u', 1);
        let descr = if header.descr == "'|u1'" { header.descr } else { native };
        match header.shape[..] {
            [n] => Ok((descr, n as u64)),
            _ => Err(refused(
                &self.root,
                name,
                format!("holds shape {:?}, expected uint8[n]", header.shape),
            )),
        }
    }

    /// A replay checkpoint's ingress samples as the queue the table takes them from.
    fn queued(
        &self,
        backend: &Backend,
        leaves: &[&[u8]],
        priorities: &[f64],
    ) -> Result<QueuedSamples, EchoError> {
        let spec = backend.spec();
        let mut queued = QueuedSamples::new(spec.payload_size());
        if priorities.is_empty() {
            return Ok(queued);
        }
        let rows = Rows::new(spec, leaves, priorities.len(), None)
            .map_err(|e| self.restore_error(format!("ingress samples: {e}")))?;
        let mut payload = Vec::with_capacity(spec.payload_size());
        for (i, &priority) in priorities.iter().enumerate() {
            payload.clear();
            for leaf in 0..spec.len() {
                payload.extend_from_slice(rows.row_leaf(i, leaf));
            }
            let priority = (!priority.is_nan()).then_some(priority);
            if let Some(p) = priority {
                backend
                    .check_priority(p)
                    .map_err(|e| self.restore_error(format!("ingress sample {i}: {e}")))?;
            }
            queued.push(&payload, priority);
        }
        Ok(queued)
    }

    /// What the backend refused, as a checkpoint error naming the checkpoint (I/O and a busy
    /// table stay as they are).
    fn restore_error(&self, e: impl Into<RestoreFailure>) -> EchoError {
        match e.into() {
            RestoreFailure::Echo(
                e @ (EchoError::Io(_) | EchoError::Busy(_) | EchoError::OutOfMemory { .. }),
            ) => e,
            RestoreFailure::Echo(EchoError::Checkpoint(m)) => EchoError::Checkpoint(m),
            RestoreFailure::Echo(EchoError::Config(m)) => self.named(m),
            RestoreFailure::Echo(e) => self.named(e.to_string()),
            RestoreFailure::Text(m) => self.named(m),
        }
    }

    fn named(&self, what: String) -> EchoError {
        EchoError::Checkpoint(format!("{}: {what}", self.root.display()))
    }
}

/// An error a restore step gives: the core's, or a message.
enum RestoreFailure {
    Echo(EchoError),
    Text(String),
}

impl From<EchoError> for RestoreFailure {
    fn from(e: EchoError) -> Self {
        Self::Echo(e)
    }
}

impl From<String> for RestoreFailure {
    fn from(e: String) -> Self {
        Self::Text(e)
    }
}
