//! The learner's published parameters ([`ParamStore`]): a pytree of arrays fixed in layout per
//! server, published in versions that only grow, and read back in chunks by whoever serves
//! them to workers (a TCP connection's task, one chunk per request).
//!
//! Two slots hold at most two versions, whatever the number of readers: the latest and the
//! one before it. A publish writes the slot that does not hold the latest version, under that
//! slot's write lock, and then makes it the latest. A reader copies one chunk of a version
//! under the read lock of the slot that holds it: a chunk never mixes two versions (no torn
//! read), and a reader never holds a slot longer than one chunk's copy, so a publish waits at
//! most for the chunks being copied from the slot it overwrites, never for a slow socket. A
//! reader whose version was overwritten meanwhile (two publishes during its transfer) is told
//! [`Superseded`] with the latest version, and starts that one over.
//!
//! Publishing takes only these locks: never the backend's, the ingress's or the consumer's, so
//! it blocks neither `sample()` nor the ingress.

use std::sync::OnceLock;

use parking_lot::{Mutex, RwLock};
use tokio::sync::watch;

use crate::codec::{in_parts, threads_for, Codec, COMPRESS_BYTES_PER_THREAD};
use crate::error::EchoError;
use crate::metrics::Counter;
use crate::spec::DataSpec;
use crate::sync::AtomicU64;
#[cfg(target_os = "linux")]
use crate::transport::shm::params::ParamRegion;
use std::sync::atomic::Ordering::{Acquire, Release};
#[cfg(target_os = "linux")]
use std::sync::Arc;

/// A server's parameter channel: its [`ParamStore`], made by the first publish (which fixes
/// the layout), and a watch of the latest version that the transport's connections follow
/// to tell their workers.
pub struct Params {
    store: OnceLock<ParamStore>,
    /// The shared-memory region the store's slots live in (Linux), made by the first publish
    /// or the first worker that attaches shared memory; `None` inside when it could not be.
    #[cfg(target_os = "linux")]
    region: OnceLock<Option<Arc<ParamRegion>>>,
    latest: watch::Sender<u64>,
    /// The parameters' description (opaque bytes: the Python layer's pytree structure),
    /// served to workers without a layout of their own; empty when none was given.
    description: Mutex<std::sync::Arc<[u8]>>,
    /// Chunks being served to workers at once: a turn each, in the order asked (see
    /// [`Params::chunk_turn`]), and the buffers they are copied into, kept for the next.
    turns: tokio::sync::Semaphore,
    buffers: Mutex<Vec<Vec<u8>>>,
    /// Publishes, and the chunks and bytes the transport served to workers.
    published: Counter,
    chunks_served: Counter,
    bytes_served: Counter,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            store: OnceLock::new(),
            #[cfg(target_os = "linux")]
            region: OnceLock::new(),
            latest: watch::Sender::new(0),
            description: Mutex::new(std::sync::Arc::from(Vec::new())),
            turns: tokio::sync::Semaphore::new(CHUNK_TURNS),
            buffers: Mutex::new(Vec::new()),
            published: Counter::new(0),
            chunks_served: Counter::new(0),
            bytes_served: Counter::new(0),
        }
    }
}

/// What [`Params::counts`] reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ParamCounts {
    /// The latest version (0: none published).
    pub version: u64,
    /// Publishes.
    pub published: u64,
    /// Chunks served to workers (one per fetch request answered with bytes).
    pub chunks_served: u64,
    /// Bytes of parameters served to workers.
    pub bytes_served: u64,
}

impl std::fmt::Debug for Params {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Params").field("store", &self.store.get()).finish()
    }
}

impl Params {
    /// Publishes `leaves` of layout `spec` (see [`ParamStore::publish`]), compressed for TCP
    /// workers with `codec`; the first publish fixes the layout.
    ///
    /// # Errors
    /// [`EchoError::Config`] for a layout other than the first publish's, or as
    /// [`ParamStore::publish`]. Nothing is published then.
    pub fn publish(
        &self,
        spec: &DataSpec,
        leaves: &[&[u8]],
        version: Option<u64>,
        codec: Option<Codec>,
    ) -> Result<u64, EchoError> {
        let store = self.store.get_or_init(|| self.new_store(spec));
        if store.spec() != spec {
            return Err(EchoError::Config(format!(
                "the parameters' layout is fixed by the first publish: {} leaves of {} bytes, \
                 got {} leaves of {} bytes",
                store.spec().len(),
                store.size(),
                spec.len(),
                spec.payload_size()
            )));
        }
        let version = store.publish(leaves, version, codec)?;
        self.latest.send_replace(version);
        self.published.add(1);
        Ok(version)
    }

    /// Sets the parameters' description (see [`Params::description`]).
    pub fn describe(&self, description: Vec<u8>) {
        *self.description.lock() = std::sync::Arc::from(description);
    }

    /// The parameters' description: what a worker without a layout of its own fetches to
    /// learn it (empty: none given).
    pub fn description(&self) -> std::sync::Arc<[u8]> {
        std::sync::Arc::clone(&self.description.lock())
    }

    /// Waits for a turn to serve one chunk to a worker, and lends the buffer to copy it into
    /// (given back when the [`ChunkTurn`] is dropped). Turns are taken in the order asked
    /// (a fair queue), and at most [`CHUNK_TURNS`] chunks are served at once, however many
    /// workers fetch: the chunks copied out of the store take at most that many chunk
    /// buffers, outside the samples' byte budget, so fetching workers never hold back the
    /// ingress.
    pub async fn chunk_turn(&self) -> ChunkTurn<'_> {
        let permit = self.turns.acquire().await.expect("the semaphore is never closed");
        let bytes = self.buffers.lock().pop().unwrap_or_default();
        ChunkTurn { params: self, permit: Some(permit), bytes }
    }

    /// Counts a chunk of `bytes` served to a worker.
    pub fn note_served(&self, bytes: usize) {
        self.chunks_served.add(1);
        self.bytes_served.add(bytes as u64);
    }

    /// The counters.
    pub fn counts(&self) -> ParamCounts {
        ParamCounts {
            version: self.latest(),
            published: self.published.get(),
            chunks_served: self.chunks_served.get(),
            bytes_served: self.bytes_served.get(),
        }
    }

    /// A store for `spec`, its slots in the shared region when there is one.
    fn new_store(&self, spec: &DataSpec) -> ParamStore {
        #[cfg(target_os = "linux")]
        if let Some(region) = self.region() {
            match region.hold(spec.payload_size()) {
                Ok(()) => return ParamStore::in_region(spec.clone(), Arc::clone(region)),
                Err(e) => log::warn!(
                    "the published parameters stay out of shared memory (workers on this \
                     host fetch them through their socket): {e}"
                ),
            }
        }
        ParamStore::new(spec.clone())
    }

    /// The shared-memory region workers on this host copy the parameters from (made on the
    /// first call); `None` when it cannot be made.
    #[cfg(target_os = "linux")]
    pub fn region(&self) -> Option<&Arc<ParamRegion>> {
        self.region
            .get_or_init(|| match ParamRegion::create() {
                Ok(region) => Some(Arc::new(region)),
                Err(e) => {
                    log::warn!("no shared-memory region for the published parameters: {e}");
                    None
                }
            })
            .as_ref()
    }

    /// The store, once something was published.
    pub fn store(&self) -> Option<&ParamStore> {
        self.store.get()
    }

    /// The latest version (0: none).
    pub fn latest(&self) -> u64 {
        self.store().map_or(0, ParamStore::latest)
    }

    /// Follows the latest version (what the transport's connections tell their workers).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.latest.subscribe()
    }
}

/// Chunks served to workers at once ([`Params::chunk_turn`]).
pub const CHUNK_TURNS: usize = 16;

/// A turn to serve one chunk, with the buffer to copy it into ([`Params::chunk_turn`]).
pub struct ChunkTurn<'a> {
    params: &'a Params,
    permit: Option<tokio::sync::SemaphorePermit<'a>>,
    /// The buffer, of any length: the caller sizes it.
    pub bytes: Vec<u8>,
}

impl ChunkTurn<'_> {
    /// Lets the next worker's chunk be served while this one's bytes are still being
    /// written (a worker slow to read them takes no turn from the others); the buffer is
    /// still this turn's.
    pub fn pass(&mut self) {
        self.permit = None;
    }
}

impl Drop for ChunkTurn<'_> {
    fn drop(&mut self) {
        let mut buffers = self.params.buffers.lock();
        if buffers.len() < CHUNK_TURNS {
            buffers.push(std::mem::take(&mut self.bytes));
        }
    }
}

/// One version's bytes: every leaf raw, back to back in the layout's order, and its chunks
/// compressed when it was published with a codec.
#[derive(Default)]
struct Slot {
    /// 0: never written.
    version: u64,
    bytes: Box<[u8]>,
    packed: Packed,
}

/// The bytes of a version compressed chunk by chunk ([`CHUNK_BYTES`] raw bytes each, the
/// last one shorter), for workers that fetch over TCP: compressed once when published,
/// served to every worker. A chunk that does not shrink is served raw.
#[derive(Default)]
struct Packed {
    codec: Option<Codec>,
    /// Per chunk: where its compressed bytes lie in `bytes`, or `None` for a chunk served
    /// raw.
    chunks: Vec<Option<std::ops::Range<usize>>>,
    bytes: Vec<u8>,
}

/// Raw bytes per compressed chunk: the most a worker asks for at a time over TCP, so that one
/// request gets one compressed chunk.
pub const CHUNK_BYTES: usize = crate::transport::wire::params::MAX_CHUNK as usize;

impl Packed {
    /// `raw` compressed chunk by chunk with `codec` (several threads for large parameters),
    /// into the buffers of the version this slot held before.
    fn compress(&mut self, raw: &[u8], codec: Option<Codec>) {
        self.codec = codec;
        self.chunks.clear();
        self.bytes.clear();
        let Some(codec) = codec else { return };
        let chunks: Vec<&[u8]> = raw.chunks(CHUNK_BYTES).collect();
        let most = std::thread::available_parallelism().map_or(1, usize::from);
        let threads = threads_for(raw.len(), COMPRESS_BYTES_PER_THREAD, chunks.len(), most);
        let parts = in_parts(&chunks, threads, |_, part| {
            let mut out = Vec::new();
            let sizes: Vec<usize> = part
                .iter()
                .map(|chunk| {
                    let before = out.len();
                    codec.compress_append(chunk, &mut out);
                    out.len() - before
                })
                .collect();
            (sizes, out)
        });
        for (sizes, out) in parts {
            let mut at = 0;
            for (size, chunk) in sizes.into_iter().zip(&chunks[self.chunks.len()..]) {
                let packed = &out[at..at + size];
                at += size;
                if size < chunk.len() {
                    let start = self.bytes.len();
                    self.bytes.extend_from_slice(packed);
                    self.chunks.push(Some(start..self.bytes.len()));
                } else {
                    self.chunks.push(None);
                }
            }
        }
    }

    /// The compressed bytes of the chunk that starts at `offset` and holds `len` raw bytes
    /// of a version of `size` bytes, when it is exactly one of this version's compressed
    /// chunks.
    fn chunk(&self, offset: usize, len: usize, size: usize) -> Option<(Codec, &[u8])> {
        let codec = self.codec?;
        let index = offset / CHUNK_BYTES;
        let whole = offset % CHUNK_BYTES == 0 && len == (size - offset).min(CHUNK_BYTES);
        if !whole {
            return None;
        }
        let range = self.chunks.get(index)?.clone()?;
        Some((codec, &self.bytes[range]))
    }
}

/// One chunk as [`ParamStore::read_chunk`] gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkBytes {
    /// Raw: the bytes asked for.
    Raw,
    /// Compressed with this codec: it decompresses to the bytes asked for.
    Packed(Codec),
}

/// A reader's version is no longer held: two publishes overwrote it. `latest` is the version
/// to fetch instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Superseded {
    /// The latest version now.
    pub latest: u64,
}

/// The published parameters of one server (see the module docs).
pub struct ParamStore {
    spec: DataSpec,
    slots: [RwLock<Slot>; 2],
    /// The latest version (0: nothing published yet). Stored with Release after its slot is
    /// written, so a reader that sees a version finds it in a slot.
    latest: AtomicU64,
    /// Serialises publishers (one version at a time, in order).
    publishing: Mutex<()>,
    /// Where the slots' bytes live when not on the heap: the shared region (the `RwLock`s
    /// still order this process's readers and writer; other processes read through the
    /// region's sequence locks).
    #[cfg(target_os = "linux")]
    region: Option<Arc<ParamRegion>>,
}

impl std::fmt::Debug for ParamStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamStore")
            .field("leaves", &self.spec.len())
            .field("bytes", &self.spec.payload_size())
            .field("latest", &self.latest())
            .finish_non_exhaustive()
    }
}

impl ParamStore {
    /// A store for parameters of layout `spec`, with nothing published. Allocates nothing
    /// until the first publish.
    pub fn new(spec: DataSpec) -> Self {
        Self {
            spec,
            slots: [RwLock::new(Slot::default()), RwLock::new(Slot::default())],
            latest: AtomicU64::new(0),
            publishing: Mutex::new(()),
            #[cfg(target_os = "linux")]
            region: None,
        }
    }

    /// A store whose slots are `region`'s (which holds versions of `spec`'s size).
    #[cfg(target_os = "linux")]
    pub fn in_region(spec: DataSpec, region: Arc<ParamRegion>) -> Self {
        Self { region: Some(region), ..Self::new(spec) }
    }

    /// The parameters' layout.
    pub fn spec(&self) -> &DataSpec {
        &self.spec
    }

    /// Bytes of one version: every leaf raw.
    pub fn size(&self) -> usize {
        self.spec.payload_size()
    }

    /// The latest published version; 0 before the first publish.
    pub fn latest(&self) -> u64 {
        // ORDERING: Acquire pairs with the Release in `publish`: the version's slot is written.
        self.latest.load(Acquire)
    }

    /// Publishes `leaves` (one byte slice per leaf, each its leaf's exact size) as `version`,
    /// or as the latest version plus one when `None`. Returns the version published. Waits
    /// only for readers copying a chunk out of the slot it overwrites. With `codec`, the
    /// version is also compressed chunk by chunk (see [`ParamStore::read_chunk`]) before it
    /// becomes the latest.
    ///
    /// # Errors
    /// [`EchoError::LeafCount`] or [`EchoError::SizeMismatch`] for leaves that do not fit the
    /// layout; [`EchoError::Config`] for a version that does not grow (0, or not above the
    /// latest). Nothing is published then.
    pub fn publish(
        &self,
        leaves: &[&[u8]],
        version: Option<u64>,
        codec: Option<Codec>,
    ) -> Result<u64, EchoError> {
        if leaves.len() != self.spec.len() {
            return Err(EchoError::LeafCount { expected: self.spec.len(), got: leaves.len() });
        }
        for (leaf, bytes) in leaves.iter().enumerate() {
            let expected = self.spec.leaf_range(leaf).len();
            if bytes.len() != expected {
                return Err(EchoError::SizeMismatch { leaf, expected, got: bytes.len() });
            }
        }
        let _publishing = self.publishing.lock();
        let latest = self.latest();
        let version = match version {
            None => latest.checked_add(1).ok_or_else(|| {
                EchoError::Config("the parameters' version cannot grow past 2**64 - 1".into())
            })?,
            Some(v) if v > latest => v,
            Some(v) => {
                return Err(EchoError::Config(format!(
                    "a published version must be above the latest ({latest}), got {v}"
                )))
            }
        };
        // The slot that does not hold the latest version (both are free before the second
        // publish).
        let spare = usize::from(self.slots[0].read().version == latest && latest != 0);
        {
            let mut slot = self.slots[spare].write();
            let fill = |out: &mut [u8]| {
                for (leaf, bytes) in leaves.iter().enumerate() {
                    out[self.spec.leaf_range(leaf)].copy_from_slice(bytes);
                }
            };
            #[cfg(target_os = "linux")]
            if let Some(region) = &self.region {
                region.write(spare, version, fill);
                // Compressed from the region once it is written (workers on this host copy
                // it meanwhile).
                let Slot { packed, .. } = &mut *slot;
                region.read(spare, |raw| packed.compress(raw, codec));
                slot.version = version;
                drop(slot);
                // ORDERING: Release pairs with the Acquire in `latest`, as below.
                self.latest.store(version, Release);
                return Ok(version);
            }
            if slot.bytes.len() != self.size() {
                slot.bytes = vec![0u8; self.size()].into_boxed_slice();
            }
            fill(&mut slot.bytes);
            let Slot { bytes, packed, .. } = &mut *slot;
            packed.compress(bytes, codec);
            slot.version = version;
        }
        // ORDERING: Release pairs with the Acquire in `latest`: the slot is written (and its
        // lock released) before a reader can ask for this version.
        self.latest.store(version, Release);
        Ok(version)
    }

    /// Copies bytes `offset..offset + out.len()` of `version` into `out`, all from that one
    /// version.
    ///
    /// # Errors
    /// [`Superseded`] (with the latest version) when neither slot holds `version` any more, or
    /// it was never published. The caller checks `offset + out.len() <= size()`; beyond that
    /// this panics.
    pub fn read(&self, version: u64, offset: usize, out: &mut [u8]) -> Result<(), Superseded> {
        for (index, slot) in self.slots.iter().enumerate() {
            let slot = slot.read();
            if slot.version == version && version != 0 {
                let mut copy =
                    |bytes: &[u8]| out.copy_from_slice(&bytes[offset..offset + out.len()]);
                #[cfg(target_os = "linux")]
                if let Some(region) = &self.region {
                    region.read(index, copy);
                    return Ok(());
                }
                let _ = index;
                copy(&slot.bytes);
                return Ok(());
            }
        }
        Err(Superseded { latest: self.latest() })
    }

    /// One chunk of `version` for a worker over TCP: bytes `offset..offset + len` into
    /// `out` (replacing what it held), compressed when the version was published with a
    /// codec and this is one of its compressed chunks ([`CHUNK_BYTES`] from a multiple of
    /// it), else raw. Says which.
    ///
    /// # Errors
    /// As [`ParamStore::read`].
    pub fn read_chunk(
        &self,
        version: u64,
        offset: usize,
        len: usize,
        out: &mut Vec<u8>,
    ) -> Result<ChunkBytes, Superseded> {
        for slot in &self.slots {
            let slot = slot.read();
            if slot.version == version && version != 0 {
                if let Some((codec, packed)) = slot.packed.chunk(offset, len, self.size()) {
                    out.clear();
                    out.extend_from_slice(packed);
                    return Ok(ChunkBytes::Packed(codec));
                }
                break;
            }
        }
        out.resize(len, 0);
        self.read(version, offset, out).map(|()| ChunkBytes::Raw)
    }

    /// The latest version and a copy of its bytes (for a checkpoint); `None` before the
    /// first publish.
    pub fn snapshot(&self) -> Option<(u64, Vec<u8>)> {
        for _ in 0..16 {
            let version = self.latest();
            if version == 0 {
                return None;
            }
            let mut out = vec![0u8; self.size()];
            if self.read(version, 0, &mut out).is_ok() {
                return Some((version, out));
            }
            // Two publishes overtook the copy: take the newer one.
        }
        // Publishers that overtake every copy: wait for one of them instead.
        let _publishing = self.publishing.lock();
        let version = self.latest();
        let mut out = vec![0u8; self.size()];
        self.read(version, 0, &mut out).ok().map(|()| (version, out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::ArraySpec;
    use std::sync::atomic::Ordering::Relaxed;
    use std::sync::atomic::{AtomicBool, AtomicU32};
    use std::sync::Arc;

    /// Two leaves: 3 f32 and 5 u8 (17 bytes).
    fn store() -> ParamStore {
        let spec = DataSpec::new(vec![
            ArraySpec::new(vec![3], 4).unwrap(),
            ArraySpec::new(vec![5], 1).unwrap(),
        ])
        .unwrap();
        ParamStore::new(spec)
    }

    /// Version `v`'s leaves: every byte `v`'s low byte, so a torn read shows.
    fn leaves(v: u64) -> (Vec<u8>, Vec<u8>) {
        let b = v.to_le_bytes()[0];
        (vec![b; 12], vec![b; 5])
    }

    fn publish(store: &ParamStore, v: Option<u64>, bytes: u64) -> Result<u64, EchoError> {
        let (a, b) = leaves(bytes);
        store.publish(&[&a, &b], v, None)
    }

    #[test]
    fn versions_grow_by_one_or_as_given_and_never_go_back() {
        let s = store();
        assert_eq!(s.latest(), 0);
        assert_eq!(s.snapshot(), None);
        assert_eq!(publish(&s, None, 1).unwrap(), 1);
        assert_eq!(publish(&s, None, 2).unwrap(), 2);
        assert_eq!(publish(&s, Some(10), 10).unwrap(), 10);
        let err = publish(&s, Some(10), 11).unwrap_err().to_string();
        assert!(err.contains("above the latest (10), got 10"), "{err}");
        assert!(publish(&s, Some(3), 3).is_err());
        assert_eq!(s.latest(), 10, "a refused publish changes nothing");
        let (version, bytes) = s.snapshot().unwrap();
        assert_eq!((version, bytes), (10, vec![10u8; 17]));
    }

    #[test]
    fn leaves_that_do_not_fit_are_refused_and_nothing_is_published() {
        let s = store();
        let (a, b) = leaves(1);
        assert!(matches!(
            s.publish(&[&a], None, None),
            Err(EchoError::LeafCount { expected: 2, got: 1 })
        ));
        assert!(matches!(
            s.publish(&[&a, &b[..4]], None, None),
            Err(EchoError::SizeMismatch { leaf: 1, expected: 5, got: 4 })
        ));
        assert_eq!(s.latest(), 0);
    }

    #[test]
    fn the_two_latest_versions_are_readable_and_an_older_one_is_superseded() {
        let s = store();
        for v in 1..=3 {
            publish(&s, None, v).unwrap();
        }
        let mut out = [0u8; 4];
        s.read(3, 13, &mut out).unwrap();
        assert_eq!(out, [3; 4]);
        s.read(2, 0, &mut out).unwrap();
        assert_eq!(out, [2; 4], "the version before the latest is still held");
        assert_eq!(s.read(1, 0, &mut out), Err(Superseded { latest: 3 }));
        assert_eq!(s.read(0, 0, &mut out), Err(Superseded { latest: 3 }));
        assert_eq!(s.read(9, 0, &mut out), Err(Superseded { latest: 3 }));
    }

    #[test]
    fn readers_never_see_a_torn_chunk_while_a_publisher_runs() {
        // A publisher writes versions 1.. (every byte the version's low byte) while readers
        // fetch whole versions chunk by chunk, starting over when superseded: every chunk is
        // uniform, and each reader's completed copies are uniform and never go back.
        let s = Arc::new(store());
        publish(&s, None, 1).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let copies: Arc<[AtomicU32; 3]> = Arc::new(Default::default());
        let readers: Vec<_> = (0..3)
            .map(|reader| {
                let (s, stop, copies) = (Arc::clone(&s), Arc::clone(&stop), Arc::clone(&copies));
                std::thread::spawn(move || {
                    let (mut last, mut whole) = (0u64, 0u32);
                    for _ in 0..200_000 {
                        // ORDERING: Relaxed — a stop flag; the join orders everything else.
                        if stop.load(Relaxed) {
                            break;
                        }
                        let version = s.latest();
                        let mut copy = vec![0u8; s.size()];
                        let mut ok = true;
                        for (i, chunk) in copy.chunks_mut(4).enumerate() {
                            if s.read(version, i * 4, chunk).is_err() {
                                ok = false;
                                break;
                            }
                            assert!(chunk.iter().all(|&b| b == chunk[0]), "a torn chunk");
                        }
                        if ok {
                            let b = version.to_le_bytes()[0];
                            assert!(copy.iter().all(|&x| x == b), "a torn version {version}");
                            assert!(version >= last, "went back from {last} to {version}");
                            (last, whole) = (version, whole + 1);
                            // ORDERING: Relaxed — a progress count; the join orders the rest.
                            copies[reader].fetch_add(1, Relaxed);
                        }
                    }
                    whole
                })
            })
            .collect();
        for v in 2..20_000 {
            publish(&s, None, v).unwrap();
        }
        // Flat out, a reader on a loaded machine may be overtaken every time: then slower,
        // until each has completed a copy (or 10 s).
        let slow_until = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut v = 20_000;
        // ORDERING: Relaxed — as above.
        while copies.iter().any(|c| c.load(Relaxed) == 0) && std::time::Instant::now() < slow_until
        {
            publish(&s, None, v).unwrap();
            v += 1;
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        // ORDERING: Relaxed — as above.
        stop.store(true, Relaxed);
        for reader in readers {
            assert!(reader.join().unwrap() > 0, "a reader completed no copy");
        }
    }
}
