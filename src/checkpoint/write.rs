//! Writing a checkpoint: the backend's snapshot into its files, the learner's `extra`, then
//! the manifest, in a new directory that replaces `path` atomically once complete.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::directory::{write_small, NewCheckpointDir};
use super::manifest::{
    CodecEntry, Counts, FileEntry, IngressFiles, Kind, Layout, LeafEntry, Manifest, SessionEntry,
    Settings, TableStateEntry, Tuning, EXTRA, INGRESS_PRIORITIES, MANIFEST, META_FILES,
    SEQUENCE_META,
};
use super::npy::{as_bytes, write_leaf_files, write_npy, write_npy_1d, LeafFile, QueuedChunks};
use super::Example;
use crate::backend::{Backend, BackendCheckpoint};
use crate::codec::LeafCodecs;
use crate::error::EchoError;
use crate::queued::QueuedSamples;

/// The moments of a checkpoint a test can observe (and kill the process at).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The data files are complete; nothing else is written.
    LeavesWritten,
    /// The extra's files are complete (only with an extra); no manifest yet.
    ExtraWritten,
    /// The new directory is complete; `path` does not point at it yet.
    BeforeSwap,
}

impl Stage {
    /// `leaves-written`, `extra-written`, `before-swap`.
    pub fn name(self) -> &'static str {
        match self {
            Self::LeavesWritten => "leaves-written",
            Self::ExtraWritten => "extra-written",
            Self::BeforeSwap => "before-swap",
        }
    }
}

/// One array of the learner's `extra` tree, as its `.npy` file holds it.
#[derive(Debug, Clone)]
pub struct ExtraArray<'a> {
    /// The dtype as a Python literal (`'<f4'`).
    pub descr: String,
    /// The array's shape (`[]` for a scalar).
    pub shape: Vec<usize>,
    /// Its bytes, C order.
    pub data: &'a [u8],
}

/// The learner's `extra`: the encoded tree (`extra.json`) and its arrays, which the tree
/// names `extra_000.npy`, ... in order.
#[derive(Debug, Clone)]
pub struct Extra<'a> {
    /// `extra.json`'s bytes.
    pub tree: &'a [u8],
    /// The arrays.
    pub arrays: Vec<ExtraArray<'a>>,
}

/// What a checkpoint records beside the backend's snapshot.
#[derive(Debug)]
pub struct CheckpointRequest<'a> {
    /// Where it goes: a new path, or a checkpoint link to replace.
    pub path: &'a Path,
    /// The settings that are part of the data.
    pub settings: Settings,
    /// The settings that only tune.
    pub tuning: Tuning,
    /// The server's example.
    pub example: &'a Example,
    /// The learner's state.
    pub extra: Option<Extra<'a>>,
}

/// The files a checkpoint of one backend kind writes, named, with their entries as written.
struct Files {
    dir: NewCheckpointDir,
    entries: BTreeMap<String, FileEntry>,
}

impl Files {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.file(name)
    }

    /// Records `name`'s digest with its size on disk.
    fn add(&mut self, name: &str, digest: &[u8; 32]) -> Result<(), EchoError> {
        let bytes = fs::metadata(self.path(name))?.len();
        self.entries.insert(name.to_owned(), FileEntry::new(digest, bytes));
        Ok(())
    }

    fn add_all(&mut self, names: &[String], digests: &[[u8; 32]]) -> Result<(), EchoError> {
        for (name, digest) in names.iter().zip(digests) {
            self.add(name, digest)?;
        }
        Ok(())
    }

    /// The `.npy` outputs of every leaf, under `names`.
    fn leaf_files(&self, example: &Example, names: &[String]) -> Vec<LeafFile> {
        example
            .leaves
            .iter()
            .zip(names)
            .map(|(leaf, name)| LeafFile {
                path: self.path(name),
                descr: leaf.npy_descr.clone(),
                shape: leaf.shape.clone(),
                raw: false,
            })
            .collect()
    }
}

fn numbered(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}leaf_{i:03}.npy")).collect()
}

/// The leaves a table stores compressed, renamed in `names` (`leaf_001.zst`, with no `.npy`
/// header: the rows as stored) and marked raw in `files`; returns each one's lengths file and
/// its manifest entry.
fn packed(
    codecs: Option<&LeafCodecs>,
    names: &mut [String],
    files: &mut [LeafFile],
    dir: &Files,
) -> Vec<(usize, CodecEntry, String)> {
    let Some(codecs) = codecs else { return Vec::new() };
    codecs
        .packed_leaves()
        .iter()
        .filter_map(|&leaf| {
            let codec = codecs.get(leaf)?;
            let ext = if codec.name() == "zstd" { "zst" } else { "lz4" };
            names[leaf] = format!("leaf_{leaf:03}.{ext}");
            files[leaf].path = dir.path(&names[leaf]);
            files[leaf].raw = true;
            Some((leaf, CodecEntry(codec), format!("leaf_{leaf:03}.lengths.npy")))
        })
        .collect()
}

/// Writes a checkpoint of `backend` (see [`CheckpointRequest`]); `capture` takes the
/// acknowledged samples held outside the backend at the snapshot's moment. `hook` runs at each
/// [`Stage`]; its error abandons the checkpoint. Returns the bytes its files hold (the
/// manifest included).
///
/// # Errors
/// [`EchoError::Busy`] while another checkpoint of the backend runs; `AlreadyExists` if
/// `path` is not a checkpoint link; I/O errors; the hook's. Nothing at `path` changes then.
pub fn write(
    backend: &Backend,
    capture: impl FnOnce() -> QueuedSamples,
    request: CheckpointRequest<'_>,
    hook: &mut dyn FnMut(Stage) -> Result<(), EchoError>,
) -> Result<u64, EchoError> {
    let example = request.example;
    let leaves = example.leaves.len();
    if leaves != backend.spec().len() {
        return Err(EchoError::Config(format!(
            "checkpoint: the example has {leaves} leaves, the server {}",
            backend.spec().len()
        )));
    }
    let mut out = Files { dir: NewCheckpointDir::create(request.path)?, entries: BTreeMap::new() };
    let mut names = numbered("", leaves);
    let ingress_names = numbered("ingress_", leaves);
    let mut files = out.leaf_files(example, &names);
    let ingress_files = out.leaf_files(example, &ingress_names);
    let mut manifest_extra = (None, None, None, Vec::new());
    let sessions: Vec<SessionEntry>;
    let (format, counts) = match backend.checkpoint(capture)? {
        BackendCheckpoint::Fifo(mut snapshot) => {
            sessions = snapshot.queued.sessions.iter().map(SessionEntry::new).collect();
            let digests = write_leaf_files(&mut snapshot, &files)?;
            out.add_all(&names, &digests)?;
            let from_ring = snapshot.ring_rows() as u64;
            let from_ingress = snapshot.queued.len() as u64;
            let counts = Counts {
                items: from_ring + from_ingress,
                from_ring: Some(from_ring),
                from_ingress: Some(from_ingress),
                handed_out_before: Some(snapshot.ring.handed_out()),
                ..Counts::default()
            };
            (Kind::Fifo, counts)
        }
        BackendCheckpoint::Replay(mut checkpoint, queued) => {
            sessions = queued.sessions.iter().map(SessionEntry::new).collect();
            let packed = packed(checkpoint.codecs(), &mut names, &mut files, &out);
            if !packed.is_empty() {
                checkpoint.keep_packed();
            }
            let digests = write_leaf_files(&mut checkpoint, &files)?;
            out.add_all(&names, &digests)?;
            let items = checkpoint.items();
            let metas: [(&[u8], char, usize); 3] = [
                (as_bytes(&items.keys), 'u', 8),
                (as_bytes(&items.priorities), 'f', 8),
                (as_bytes(&items.times_sampled), 'u', 4),
            ];
            for (name, (bytes, kind, size)) in META_FILES.iter().zip(metas) {
                let digest = write_npy_1d(&out.path(name), kind, bytes, size)?;
                out.add(name, &digest)?;
            }
            for ((_, _, lengths_name), lengths) in packed.iter().zip(checkpoint.packed_lengths()) {
                let digest = write_npy_1d(&out.path(lengths_name), 'u', as_bytes(lengths), 4)?;
                out.add(lengths_name, &digest)?;
            }
            if !queued.is_empty() {
                let digests = write_leaf_files(
                    &mut QueuedChunks::new(checkpoint.spec(), &queued),
                    &ingress_files,
                )?;
                out.add_all(&ingress_names, &digests)?;
                let priorities: Vec<f64> =
                    queued.priorities.iter().map(|p| p.unwrap_or(f64::NAN)).collect();
                let path = out.path(INGRESS_PRIORITIES);
                let digest = write_npy_1d(&path, 'f', as_bytes(&priorities), 8)?;
                out.add(INGRESS_PRIORITIES, &digest)?;
                manifest_extra.1 = Some(IngressFiles {
                    files: ingress_names.clone(),
                    priorities: Some(INGRESS_PRIORITIES.to_owned()),
                });
            }
            let state = checkpoint.state();
            manifest_extra.0 = Some(TableStateEntry {
                inserts: state.inserts,
                samples: state.samples,
                rng: state.rng,
                next_key: state.next_key,
                max_priority: state.max_priority,
            });
            manifest_extra.3 = packed;
            let counts = Counts {
                items: checkpoint.len() as u64,
                from_ingress: Some(queued.len() as u64),
                ..Counts::default()
            };
            (Kind::Replay, counts)
        }
        BackendCheckpoint::Sequence(mut checkpoint, queued) => {
            sessions = queued.sessions.iter().map(SessionEntry::new).collect();
            let packed = packed(checkpoint.codecs(), &mut names, &mut files, &out);
            if !packed.is_empty() {
                checkpoint.keep_packed();
            }
            let digests = write_leaf_files(&mut *checkpoint, &files)?;
            out.add_all(&names, &digests)?;
            let snapshot = checkpoint.snapshot();
            let digest = write_npy_1d(&out.path(SEQUENCE_META), 'u', &snapshot.encode(), 1)?;
            out.add(SEQUENCE_META, &digest)?;
            for ((_, _, lengths_name), lengths) in packed.iter().zip(checkpoint.packed_lengths()) {
                let digest = write_npy_1d(&out.path(lengths_name), 'u', as_bytes(lengths), 4)?;
                out.add(lengths_name, &digest)?;
            }
            if !queued.is_empty() {
                let digests = write_leaf_files(
                    &mut QueuedChunks::new(backend.spec(), &queued),
                    &ingress_files,
                )?;
                out.add_all(&ingress_names, &digests)?;
                manifest_extra.1 =
                    Some(IngressFiles { files: ingress_names.clone(), priorities: None });
            }
            manifest_extra.2 = Some(SEQUENCE_META.to_owned());
            let counts = Counts {
                items: snapshot.steps() as u64,
                windows: Some(snapshot.windows() as u64),
                open_episodes: Some(snapshot.open_episodes() as u64),
                from_ingress: Some(snapshot.queued() as u64),
                chunks: Some(checkpoint.chunks() as u64),
                ..Counts::default()
            };
            manifest_extra.3 = packed;
            (Kind::Sequence, counts)
        }
    };
    hook(Stage::LeavesWritten)?;
    let (state, ingress, sequence, packed) = manifest_extra;
    let extra = match &request.extra {
        None => None,
        Some(extra) => {
            for (i, array) in extra.arrays.iter().enumerate() {
                let name = format!("extra_{i:03}.npy");
                let (digest, _) =
                    write_npy(&out.path(&name), &array.descr, &array.shape, array.data)?;
                out.add(&name, &digest)?;
            }
            let digest = write_small(&out.path(EXTRA), extra.tree)?;
            out.add(EXTRA, &digest)?;
            hook(Stage::ExtraWritten)?;
            Some(EXTRA.to_owned())
        }
    };
    let mut layout = Layout {
        treespec: example.treespec.clone(),
        leaves: example
            .leaves
            .iter()
            .zip(&names)
            .map(|(leaf, file)| LeafEntry {
                name: leaf.name.clone(),
                path: leaf.path.clone(),
                dtype: leaf.dtype.clone(),
                shape: leaf.shape.clone(),
                file: file.clone(),
                codec: None,
                lengths: None,
            })
            .collect(),
    };
    for (leaf, codec, lengths) in &packed {
        layout.leaves[*leaf].codec = Some(*codec);
        layout.leaves[*leaf].lengths = Some(lengths.clone());
    }
    let manifest = Manifest {
        format,
        // The lowest version that describes it: 4 only adds compressed leaf files.
        format_version: if packed.is_empty() { 3 } else { 4 },
        echo_version: env!("CARGO_PKG_VERSION").to_owned(),
        created_unix_ns: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
        settings: request.settings,
        tuning: request.tuning,
        layout,
        counts,
        state,
        sequence,
        ingress,
        extra,
        files: out.entries,
        sessions,
    };
    let json = manifest.to_json();
    write_small(&out.dir.file(MANIFEST), &json)?;
    let total = json.len() as u64 + manifest.files.values().map(|f| f.bytes).sum::<u64>();
    out.dir.commit(|| hook(Stage::BeforeSwap))?;
    Ok(total)
}
