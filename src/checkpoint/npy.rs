//! The `.npy` files of a checkpoint: written one per leaf (the numpy format: a header
//! with the dtype and shape, then the rows in order, C order), streamed from a [`Chunks`]
//! source a chunk at a time (a replay table's [`Checkpoint`], a sequence table's
//! [`SequenceCheckpoint`], the FIFO ring's [`FifoSnapshot`], an ingress capture's
//! [`QueuedChunks`]), hashed (SHA-256) while written and fsynced before returning. The
//! snapshots are the backends' own types; the [`Chunks`] face they are written through is
//! given to them here, so the backends never import the writer. The header is built here
//! because the row count is only known once the snapshot is taken; the dtype's descriptor
//! comes from the caller (the core knows only sizes). Headers are read back by
//! [`NpyHeader`], which checks a file against the dtype and shape a restore expects.
use std::fs::File;
use std::io::Write;
use std::path::PathBuf;

use sha2::{Digest, Sha256};

use crate::backend::FifoSnapshot;
use crate::error::EchoError;
use crate::queued::QueuedSamples;
use crate::replay::{Checkpoint, SequenceCheckpoint};
use crate::spec::DataSpec;

/// Rows to write, leaf by leaf, a chunk at a time.
pub trait Chunks {
    /// The layout of a row.
    fn spec(&self) -> &DataSpec;
    /// Rows in all.
    fn len(&self) -> usize;
    /// Whether there are no rows.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Puts the next rows (at least one, about `max_bytes`) into `out[l]` for each leaf `l`
    /// (cleared first); returns how many, 0 once all are out.
    fn next_chunk(&mut self, max_bytes: usize, out: &mut [Vec<u8>]) -> usize;
}

impl Chunks for Checkpoint {
    fn spec(&self) -> &DataSpec {
        Checkpoint::spec(self)
    }
    fn len(&self) -> usize {
        Checkpoint::len(self)
    }
    fn next_chunk(&mut self, max_bytes: usize, out: &mut [Vec<u8>]) -> usize {
        Checkpoint::next_chunk(self, max_bytes, out)
    }
}

impl Chunks for SequenceCheckpoint {
    fn spec(&self) -> &DataSpec {
        SequenceCheckpoint::spec(self)
    }
    fn len(&self) -> usize {
        SequenceCheckpoint::len(self)
    }
    fn next_chunk(&mut self, max_bytes: usize, out: &mut [Vec<u8>]) -> usize {
        SequenceCheckpoint::next_chunk(self, max_bytes, out)
    }
}

/// An ingress capture's samples as rows.
#[derive(Debug)]
pub struct QueuedChunks<'a> {
    spec: &'a DataSpec,
    queued: &'a QueuedSamples,
    next: usize,
}

impl<'a> QueuedChunks<'a> {
    /// The rows of `queued`, samples of `spec`.
    pub fn new(spec: &'a DataSpec, queued: &'a QueuedSamples) -> Self {
        Self { spec, queued, next: 0 }
    }
}

impl Chunks for QueuedChunks<'_> {
    fn spec(&self) -> &DataSpec {
        self.spec
    }
    fn len(&self) -> usize {
        self.queued.len()
    }
    fn next_chunk(&mut self, max_bytes: usize, out: &mut [Vec<u8>]) -> usize {
        assert_eq!(out.len(), self.spec.len(), "one buffer per leaf");
        for buf in out.iter_mut() {
            buf.clear();
        }
        let n = (max_bytes / self.spec.payload_size().max(1)).max(1).min(self.len() - self.next);
        for i in self.next..self.next + n {
            let payload = self.queued.payload(i);
            for (leaf, buf) in out.iter_mut().enumerate() {
                buf.extend_from_slice(&payload[self.spec.leaf_range(leaf)]);
            }
        }
        self.next += n;
        n
    }
}

impl Chunks for FifoSnapshot {
    fn spec(&self) -> &DataSpec {
        self.ring.spec()
    }
    fn len(&self) -> usize {
        self.ring_rows() + self.queued.len()
    }
    fn next_chunk(&mut self, max_bytes: usize, out: &mut [Vec<u8>]) -> usize {
        let n = self.ring.next_chunk(max_bytes, out);
        if n > 0 {
            return n;
        }
        let mut rest =
            QueuedChunks { spec: self.ring.spec(), queued: &self.queued, next: self.next_queued };
        let n = rest.next_chunk(max_bytes, out);
        self.next_queued = rest.next;
        n
    }
}

/// Bytes of item data copied per lock hold (summed over the leaves): long enough to amortise
/// the lock and the write call, short enough that an insert or `sample()` waiting behind it
/// waits well under a millisecond.
pub const CHUNK_BYTES: usize = 1 << 20;

/// One output file: where it goes and what its rows are.
#[derive(Debug, Clone)]
pub struct LeafFile {
    /// The file to create (it must not exist).
    pub path: PathBuf,
    /// The dtype as the `.npy` header spells it: a Python literal (`'<f4'`, or a list for a
    /// structured dtype), as `repr(numpy.lib.format.dtype_to_descr(dtype))` gives it.
    pub descr: String,
    /// One item's shape (the file's shape is `(items, *shape)`).
    pub shape: Vec<usize>,
    /// The rows as they come, without a `.npy` header: a compressed leaf's rows, whose
    /// lengths vary (a replay [`Checkpoint`] after `keep_packed`; the lengths go elsewhere).
    pub raw: bool,
}

/// The `.npy` header (format 1.0, or 2.0 when the header does not fit 64 KiB) of a C-order
/// array of dtype `descr` (a Python literal) and shape `shape`.
pub fn npy_header(descr: &str, shape: &[usize]) -> Vec<u8> {
    let dims = match shape {
        [n] => format!("({n},)"),
        _ => format!("({})", shape.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")),
    };
    let mut dict = format!("{{'descr': {descr}, 'fortran_order': False, 'shape': {dims}, }}");
    // Magic (6), version (2), length (2 or 4); the whole header is padded with spaces to a
    // multiple of 64 bytes and ends with a newline.
    let (version, prefix) =
        if dict.len() + 11 + 63 <= usize::from(u16::MAX) { (1u8, 10) } else { (2, 12) };
    let total = (prefix + dict.len() + 1).div_ceil(64) * 64;
    dict.extend(std::iter::repeat_n(' ', total - prefix - dict.len() - 1));
    dict.push('\n');
    let mut header = Vec::with_capacity(total);
    header.extend_from_slice(b"\x93NUMPY");
    header.extend_from_slice(&[version, 0]);
    if version == 1 {
        header.extend_from_slice(&u16::try_from(dict.len()).expect("checked above").to_le_bytes());
    } else {
        header.extend_from_slice(&u32::try_from(dict.len()).unwrap_or(u32::MAX).to_le_bytes());
    }
    header.extend_from_slice(dict.as_bytes());
    header
}

/// Writes every leaf of `checkpoint` into its file (`files[l]` for leaf `l`), each file
/// created new, written in full and fsynced; returns each file's SHA-256.
///
/// # Errors
/// [`EchoError::Config`] if `files` does not have one entry per leaf; [`EchoError::Io`] from
/// creating, writing or syncing a file (the files written so far are left for the caller to
/// remove with their directory).
pub fn write_leaf_files(
    checkpoint: &mut dyn Chunks,
    files: &[LeafFile],
) -> Result<Vec<[u8; 32]>, EchoError> {
    write_leaf_files_chunked(checkpoint, files, CHUNK_BYTES)
}

/// [`write_leaf_files`], copying about `chunk_bytes` per chunk (benchmarks try other sizes
/// than [`CHUNK_BYTES`]).
///
/// # Errors
/// As [`write_leaf_files`].
pub fn write_leaf_files_chunked(
    checkpoint: &mut dyn Chunks,
    files: &[LeafFile],
    chunk_bytes: usize,
) -> Result<Vec<[u8; 32]>, EchoError> {
    let leaves = checkpoint.spec().len();
    if files.len() != leaves {
        return Err(EchoError::Config(format!(
            "checkpoint: {} files for {leaves} leaves",
            files.len()
        )));
    }
    let items = checkpoint.len();
    let mut outs = Vec::with_capacity(leaves);
    for file in files {
        let mut shape = vec![items];
        shape.extend_from_slice(&file.shape);
        let header = if file.raw { Vec::new() } else { npy_header(&file.descr, &shape) };
        let mut out = File::options().write(true).create_new(true).open(&file.path)?;
        out.write_all(&header)?;
        let mut hasher = Sha256::new();
        hasher.update(&header);
        outs.push((out, hasher));
    }
    let mut chunk: Vec<Vec<u8>> = (0..leaves).map(|_| Vec::with_capacity(chunk_bytes)).collect();
    while checkpoint.next_chunk(chunk_bytes, &mut chunk) > 0 {
        for ((out, hasher), bytes) in outs.iter_mut().zip(&chunk) {
            out.write_all(bytes)?;
            hasher.update(bytes);
        }
    }
    let mut digests = Vec::with_capacity(leaves);
    for (out, hasher) in outs {
        out.sync_all()?;
        digests.push(hasher.finalize().into());
    }
    Ok(digests)
}

/// Writes `values` (native byte order) as the new `.npy` file `path` of one dimension, dtype
/// `<kind><size>` (numpy's letter, `u` or `f`), fsynced; returns its SHA-256. For the per-item
/// metadata arrays, written here with the GIL released rather than by numpy with it held.
///
/// # Errors
/// [`EchoError::Io`] from creating, writing or syncing the file.
pub fn write_npy_1d(
    path: &std::path::Path,
    kind: char,
    values: &[u8],
    size: usize,
) -> Result<[u8; 32], EchoError> {
    let header = npy_header(&native_descr(kind, size), &[values.len() / size.max(1)]);
    let mut out = File::options().write(true).create_new(true).open(path)?;
    out.write_all(&header)?;
    out.write_all(values)?;
    out.sync_all()?;
    let mut hasher = Sha256::new();
    hasher.update(&header);
    hasher.update(values);
    Ok(hasher.finalize().into())
}

/// The bytes of a slice of plain numbers, in native byte order.
pub fn as_bytes<T: Plain>(values: &[T]) -> &[u8] {
    // SAFETY: `Plain` types have no padding and every byte of them is initialised; the slice
    // covers exactly `size_of_val(values)` bytes of `values`, which it borrows.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
}

/// Numbers whose bytes can be read as `u8` (no padding bytes).
///
/// # Safety
/// Implement only for types with no padding bytes.
pub unsafe trait Plain: Copy {}
// SAFETY: a primitive integer has no padding.
unsafe impl Plain for u32 {}
// SAFETY: as above.
unsafe impl Plain for u64 {}
// SAFETY: a primitive float has no padding.
unsafe impl Plain for f64 {}

/// A `.npy` file's header, as numpy writes it: `{'descr': <literal>, 'fortran_order': <bool>,
/// 'shape': (<ints>), }`, keys in that (sorted) order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NpyHeader {
    /// The dtype's Python literal, as written (`'<f4'`, or a list for a structured dtype).
    pub descr: String,
    /// Whether the data is in Fortran order (echo never writes it so).
    pub fortran_order: bool,
    /// The array's shape.
    pub shape: Vec<usize>,
    /// Where the data starts.
    pub data_offset: usize,
}

impl NpyHeader {
    /// Reads the header at the start of `file` (format versions 1 to 3).
    ///
    /// # Errors
    /// What is wrong, for a message that names the file.
    pub fn parse(file: &[u8]) -> Result<Self, String> {
        let bad = |what: &str| Err(format!("not a readable .npy file ({what})"));
        if file.len() < 10 || &file[..6] != b"\x93NUMPY" {
            return bad("no .npy magic");
        }
        let (text_at, len) = match file[6] {
            1 => (10usize, usize::from(u16::from_le_bytes([file[8], file[9]]))),
            2 | 3 if file.len() >= 12 => {
                let len = u32::from_le_bytes([file[8], file[9], file[10], file[11]]);
                (12, usize::try_from(len).unwrap_or(usize::MAX))
            }
            _ => return bad("unknown .npy version"),
        };
        let Some(text) = text_at.checked_add(len).and_then(|end| file.get(text_at..end)) else {
            return bad("the header runs past the end of the file");
        };
        let Ok(text) = std::str::from_utf8(text) else { return bad("the header is not text") };
        let text = text.trim_end_matches([' ', '\n', '\0']);
        let Some(body) = text.strip_prefix("{'descr': ").and_then(|t| t.strip_suffix('}')) else {
            return bad("the header is not a dict of descr, fortran_order and shape");
        };
        // The descr may hold any text (field names); the rest cannot hold this key.
        let Some(at) = body.rfind(", 'fortran_order': ") else {
            return bad("the header has no fortran_order");
        };
        let descr = body[..at].to_owned();
        let rest = &body[at + ", 'fortran_order': ".len()..];
        let (fortran_order, rest) = if let Some(r) = rest.strip_prefix("False") {
            (false, r)
        } else if let Some(r) = rest.strip_prefix("True") {
            (true, r)
        } else {
            return bad("fortran_order is not a bool");
        };
        let Some(dims) = rest.strip_prefix(", 'shape': (").and_then(|r| {
            let r = r.trim_end();
            r.strip_suffix(',').unwrap_or(r).trim_end().strip_suffix(')')
        }) else {
            return bad("the header has no shape");
        };
        let shape = dims
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .map(str::parse::<usize>)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| {
                "not a readable .npy file (the shape is not a tuple of ints)".to_owned()
            })?;
        Ok(Self { descr, fortran_order, shape, data_offset: text_at + len })
    }

    /// The file's data, checked: dtype `descr` (a Python literal, as written), C order,
    /// shape `shape`, and exactly the bytes that shape holds at `item_bytes` per element.
    ///
    /// # Errors
    /// What differs, for a message that names the file.
    pub fn data<'a>(
        file: &'a [u8],
        descr: &str,
        shape: &[usize],
        item_bytes: usize,
    ) -> Result<&'a [u8], String> {
        let header = Self::parse(file)?;
        if header.descr != descr || header.shape != shape || header.fortran_order {
            return Err(format!(
                "holds {}{:?}{}, expected {descr}{shape:?}",
                header.descr,
                header.shape,
                if header.fortran_order { " in Fortran order" } else { "" }
            ));
        }
        let want = shape.iter().try_fold(item_bytes, |n, &d| n.checked_mul(d));
        let data = &file[header.data_offset..];
        if want != Some(data.len()) {
            return Err(format!(
                "{} bytes of data, its shape {shape:?} needs {}",
                data.len(),
                want.map_or_else(|| "more than fit in memory".to_owned(), |w| w.to_string())
            ));
        }
        Ok(data)
    }
}

/// The `.npy` descr of native-order numbers: `'<u8'` on little-endian machines.
pub fn native_descr(kind: char, size: usize) -> String {
    let order = if cfg!(target_endian = "little") { '<' } else { '>' };
    format!("'{order}{kind}{size}'")
}

/// Writes `data` as the new `.npy` file `path` of dtype `descr` (a Python literal) and shape
/// `shape`, fsynced; returns its SHA-256 and size.
///
/// # Errors
/// [`EchoError::Config`] if `data` does not fill `shape` at `item_bytes` per element;
/// [`EchoError::Io`] from creating, writing or syncing the file.
pub fn write_npy(
    path: &std::path::Path,
    descr: &str,
    shape: &[usize],
    data: &[u8],
) -> Result<([u8; 32], u64), EchoError> {
    let header = npy_header(descr, shape);
    let mut out = File::options().write(true).create_new(true).open(path)?;
    out.write_all(&header)?;
    out.write_all(data)?;
    out.sync_all()?;
    let mut hasher = Sha256::new();
    hasher.update(&header);
    hasher.update(data);
    Ok((hasher.finalize().into(), (header.len() + data.len()) as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_headers_are_padded_to_64_bytes_and_spell_the_shape_as_python_does() {
        let h = npy_header("'<f4'", &[3, 4]);
        assert_eq!(h.len() % 64, 0);
        assert_eq!(&h[..8], b"\x93NUMPY\x01\x00");
        let text = std::str::from_utf8(&h[10..]).unwrap();
        assert!(text.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }"));
        assert!(text.ends_with(" \n"));
        assert!(std::str::from_utf8(&npy_header("'<u8'", &[5])[10..]).unwrap().contains("(5,)"));
    }

    #[test]
    fn headers_read_back_as_written_whatever_the_shape() {
        for shape in [vec![], vec![0], vec![7], vec![3, 4, 5]] {
            let h = npy_header("[('a', '<f4'), ('b', '|u1', (2,))]", &shape);
            let parsed = NpyHeader::parse(&h).unwrap();
            assert_eq!(parsed.descr, "[('a', '<f4'), ('b', '|u1', (2,))]");
            assert_eq!(parsed.shape, shape);
            assert_eq!(parsed.data_offset, h.len());
            assert!(!parsed.fortran_order);
        }
    }

    #[test]
    fn a_header_is_checked_against_what_the_caller_expects() {
        let mut file = npy_header("'<f4'", &[2, 3]);
        file.extend_from_slice(&[0; 24]);
        assert_eq!(NpyHeader::data(&file, "'<f4'", &[2, 3], 4).unwrap().len(), 24);
        let e = NpyHeader::data(&file, "'<f8'", &[2, 3], 8).unwrap_err();
        assert!(e.contains("holds '<f4'[2, 3], expected '<f8'[2, 3]"), "{e}");
        let e = NpyHeader::data(&file[..file.len() - 1], "'<f4'", &[2, 3], 4).unwrap_err();
        assert!(e.contains("23 bytes of data"), "{e}");
        assert!(NpyHeader::parse(b"\x93NUMPY\x01\x00\xff\xff{").is_err());
        assert!(NpyHeader::parse(b"PK\x03\x04").is_err());
    }
}
