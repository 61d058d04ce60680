//! Where a checkpoint's files go, and how `path` is replaced atomically.
//!
//! `path` is a symbolic link to a sibling directory `.<name>.ckpt-<token>`. A checkpoint
//! writes a new sibling directory (every file fsynced, then the directory), points a new link
//! `.<name>.link-<token>` at it and renames that link over `path` (rename(2) replaces a link
//! atomically, where it cannot replace a non-empty directory), fsyncs the parent, and only
//! then deletes the previous directory. A process killed at any point leaves `path` naming
//! either the previous complete checkpoint or the new complete one; the next checkpoint of
//! `path` removes the leftovers ([`clean_leftovers`]). This works on Linux and macOS alike,
//! unlike `renameat2(RENAME_EXCHANGE)`, which is Linux only. One writer per `path` at a time.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use crate::error::EchoError;

/// A checkpoint directory being written beside `path`; removed on drop unless committed.
#[derive(Debug)]
pub struct NewCheckpointDir {
    target: PathBuf,
    parent: PathBuf,
    name: String,
    data_name: String,
    data_dir: PathBuf,
    link_tmp: PathBuf,
    committed: bool,
}

impl NewCheckpointDir {
    /// Creates the new data directory for a checkpoint at `path`.
    ///
    /// # Errors
    /// `AlreadyExists` ([`EchoError::Io`]) if `path` is something other than a checkpoint
    /// link or an empty directory (an empty one is removed); other I/O errors as they come.
    pub fn create(path: &Path) -> Result<Self, EchoError> {
        let target = std::path::absolute(path)?;
        let (Some(parent), Some(name)) = (target.parent(), target.file_name()) else {
            return Err(EchoError::Config(format!(
                "checkpoint(): {} is not a path a checkpoint can be written to",
                target.display()
            )));
        };
        let name = name.to_string_lossy().into_owned();
        let parent = parent.to_path_buf();
        match fs::symlink_metadata(&target) {
            Ok(meta) if meta.file_type().is_symlink() => {}
            Ok(meta) => {
                let emptied = meta.is_dir() && fs::remove_dir(&target).is_ok();
                if !emptied {
                    return Err(EchoError::Io(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        format!(
                            "checkpoint(): {} exists and is not a checkpoint link written by \
                             Server.checkpoint(); pass a new path or remove it",
                            target.display()
                        ),
                    )));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
        let token = token();
        let data_name = format!(".{name}.ckpt-{token}");
        let data_dir = parent.join(&data_name);
        let link_tmp = parent.join(format!(".{name}.link-{token}"));
        fs::create_dir(&data_dir)?;
        Ok(Self { target, parent, name, data_name, data_dir, link_tmp, committed: false })
    }

    /// The directory the files go into.
    pub fn dir(&self) -> &Path {
        &self.data_dir
    }

    /// A file of the new directory.
    pub fn file(&self, name: &str) -> PathBuf {
        self.data_dir.join(name)
    }

    /// Makes the directory `path`'s checkpoint: fsyncs it, runs `before_swap` (a test hook),
    /// swaps the link, fsyncs the parent and removes the previous checkpoint's directory and
    /// any leftovers.
    ///
    /// # Errors
    /// I/O errors, or `before_swap`'s; the new directory is removed then, `path` unchanged.
    pub fn commit(
        mut self,
        before_swap: impl FnOnce() -> Result<(), EchoError>,
    ) -> Result<(), EchoError> {
        fsync_dir(&self.data_dir)?;
        before_swap()?;
        std::os::unix::fs::symlink(&self.data_name, &self.link_tmp)?;
        fs::rename(&self.link_tmp, &self.target)?;
        self.committed = true;
        fsync_dir(&self.parent)?;
        clean_leftovers(&self.parent, &self.name, Some(&self.data_name));
        Ok(())
    }
}

impl Drop for NewCheckpointDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.data_dir);
            let _ = fs::remove_file(&self.link_tmp);
        }
    }
}

/// A name no other checkpoint of the same path takes: the time, the process, and 32 random
/// bits.
fn token() -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let mut random = [0u8; 4];
    let _ = getrandom::fill(&mut random);
    format!("{nanos:x}-{}-{:08x}", std::process::id(), u32::from_le_bytes(random))
}

/// Removes the data directories of checkpoint `name` in `parent` other than `keep` (the
/// previous checkpoint, and leftovers of checkpoints killed part-way), and its stray links.
/// Best effort: what cannot be removed now is removed by the next checkpoint.
pub fn clean_leftovers(parent: &Path, name: &str, keep: Option<&str>) {
    let Ok(entries) = fs::read_dir(parent) else { return };
    let data = format!(".{name}.ckpt-");
    let link = format!(".{name}.link-");
    for entry in entries.flatten() {
        let entry_name = entry.file_name();
        let entry_name = entry_name.to_string_lossy();
        if entry_name.starts_with(&data) && Some(&*entry_name) != keep {
            let _ = fs::remove_dir_all(entry.path());
        } else if entry_name.starts_with(&link) {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// Writes `data` to the new file `path`, fsynced; returns its SHA-256.
///
/// # Errors
/// I/O errors (`AlreadyExists` if `path` exists).
pub fn write_small(path: &Path, data: &[u8]) -> Result<[u8; 32], EchoError> {
    let mut f = File::options().write(true).create_new(true).open(path)?;
    f.write_all(data)?;
    f.sync_all()?;
    Ok(Sha256::digest(data).into())
}

fn fsync_dir(path: &Path) -> io::Result<()> {
    File::open(path)?.sync_all()
}
