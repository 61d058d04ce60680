//! A checkpoint's file, opened for reading as a restore must: by its plain name inside the
//! checkpoint directory, never through a symbolic link (a tampered directory's link to
//! `/dev/zero` or to a file elsewhere is refused), only as a regular file (a named pipe would
//! block the read forever), of exactly the size the manifest lists, then memory-mapped and
//! hashed from the mapping, which the restore then reads rows from without a copy.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use sha2::{Digest, Sha256};

use super::manifest::{hex, FileEntry};

/// A read-only mapping of a whole file (or nothing, for an empty one).
#[derive(Debug)]
pub struct MappedFile {
    ptr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is read-only and private; nothing writes through it, so shared
// references from any thread only read.
unsafe impl Send for MappedFile {}
// SAFETY: as above.
unsafe impl Sync for MappedFile {}

impl MappedFile {
    /// Opens, checks and maps `dir/name` (see the module doc); the message says what is
    /// wrong (missing, a link, not a regular file, the wrong size, a differing SHA-256).
    ///
    /// # Errors
    /// The message, for the caller to prefix with the file's path.
    pub fn open_checked(dir: &Path, name: &str, expected: &FileEntry) -> Result<Self, String> {
        let (file, meta) = open_regular(dir, name)?;
        if meta.len() != expected.bytes {
            return Err(format!(
                "{} bytes, the manifest says {} (truncated?)",
                meta.len(),
                expected.bytes
            ));
        }
        let mapped = Self::map(&file, meta.len()).map_err(|e| format!("cannot be mapped ({e})"))?;
        let digest = hex(&Sha256::digest(mapped.bytes()));
        if digest != expected.sha256 {
            return Err(format!(
                "SHA-256 {digest} differs from the manifest's {} (corrupted)",
                expected.sha256
            ));
        }
        Ok(mapped)
    }

    fn map(file: &File, len: u64) -> io::Result<Self> {
        let len = usize::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::OutOfMemory))?;
        if len == 0 {
            return Ok(Self { ptr: std::ptr::null_mut(), len: 0 });
        }
        // SAFETY: a fresh private read-only mapping of `len` bytes of an open regular file;
        // the kernel picks the address. The result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { ptr, len })
    }

    /// The file's bytes.
    ///
    /// A file truncated by another process while mapped makes reading past its new end fault
    /// (SIGBUS), as with any memory map (numpy's included): echo never changes a written
    /// checkpoint, and a restore's directory must not be changed while it runs.
    pub fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr` maps `len` readable bytes for as long as `self` lives (unmapped only
        // in `drop`), and nothing writes them through this mapping.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<u8>(), self.len) }
    }
}

/// Opens `dir/name` as a restore must (see the module doc): by name, no link followed, a
/// regular file; the message says what is wrong.
fn open_regular(dir: &Path, name: &str) -> Result<(File, std::fs::Metadata), String> {
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(dir.join(name))
        .map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => "missing".to_owned(),
            _ if e.raw_os_error() == Some(libc::ELOOP) => {
                "is a symbolic link; a checkpoint's files are regular files in its directory"
                    .to_owned()
            }
            _ => format!("cannot be opened ({e})"),
        })?;
    let meta = file.metadata().map_err(|e| format!("cannot be read ({e})"))?;
    if !meta.file_type().is_file() {
        return Err("is not a regular file".to_owned());
    }
    Ok((file, meta))
}

/// Reads the small file `dir/name` (the manifest), opened as [`MappedFile::open_checked`]
/// opens data files, refusing one above `max_bytes` before reading it.
pub(super) fn read_small(dir: &Path, name: &str, max_bytes: u64) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let (file, meta) = open_regular(dir, name)?;
    if meta.len() > max_bytes {
        return Err(format!("{} bytes, more than a manifest holds ({max_bytes})", meta.len()));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    // `take`: a file that grows after the check is still read only up to the bound.
    file.take(max_bytes + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot be read ({e})"))?;
    if bytes.len() as u64 > max_bytes {
        return Err(format!("more than a manifest holds ({max_bytes} bytes)"));
    }
    Ok(bytes)
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: `ptr`/`len` are the mapping `map` made, unmapped once, here; no slice of
            // it outlives `self` (`bytes` borrows `self`).
            unsafe { libc::munmap(self.ptr, self.len) };
        }
    }
}
