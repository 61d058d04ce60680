//! Checkpoints without Python: a server's checkpoint written and restored into a new server
//! of each kind (FIFO ring, replay table, sequence table) gives back every sample exactly
//! once (a proptest over contents and batch sizes for the replay table), and a tampered
//! directory is refused naming the file: a data file replaced by a link (to `/dev/zero`, or to
//! a file outside), a named pipe, a truncated or flipped file, a newer format version.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{decode, tagged_payload, tagged_spec, PATIENCE};
use echo::backend::BackendConfig;
use echo::checkpoint::{Example, ExampleLeaf, OpenedCheckpoint, Stage, Verify};
use echo::replay::{ReplayConfig, SequenceConfig};
use echo::server::{Server, ServerConfig};
use echo::{EchoError, Payloads};
use proptest::prelude::*;
use serde_json::json;

fn example() -> Example {
    let leaf = |name: &str, descr: &str, shape: Vec<usize>| ExampleLeaf {
        name: format!("['{name}']"),
        path: vec![json!(name)],
        dtype: json!(descr.trim_matches('\'')),
        npy_descr: descr.to_owned(),
        shape,
    };
    Example {
        treespec: "PyTreeSpec({'blob': *, 'producer': *, 'seq': *})".into(),
        leaves: vec![
            leaf("producer", "'<u4'", vec![]),
            leaf("seq", "'<u8'", vec![]),
            leaf("blob", "'|u1'", vec![13]),
        ],
    }
}

fn descrs() -> Vec<String> {
    example().leaves.into_iter().map(|l| l.npy_descr).collect()
}

fn server(backend: BackendConfig) -> Server {
    let config = ServerConfig {
        backend,
        num_drainers: 1,
        producer_queue_size: Some(8),
        wire_codecs: Vec::new(),
        name: None,
        versions: None,
    };
    Server::new(tagged_spec(), config).unwrap()
}

fn insert(server: &Server, seqs: std::ops::Range<u64>) {
    let payloads: Vec<_> = seqs.map(|seq| tagged_payload(0, seq)).collect();
    let spec = tagged_spec();
    server
        .insert(&Payloads::new(&spec, &payloads).unwrap(), None, Some(Instant::now() + PATIENCE))
        .unwrap();
}

/// The seqs of the next batch, or `None` if none comes within a short wait.
fn next_batch(server: &Server) -> Option<Vec<u64>> {
    let deadline = Instant::now() + Duration::from_millis(300);
    let mut holdback = None;
    while Instant::now() < deadline {
        let slice_end = Instant::now() + Duration::from_millis(50);
        if let Some(got) = server.sample_slice(slice_end, &mut holdback) {
            let (consumer, batch, _) = got.unwrap();
            let leaves: [Vec<u8>; 3] =
                std::array::from_fn(|leaf| consumer.read_leaf(&batch, leaf, <[u8]>::to_vec));
            return Some((0..leaves[0].len() / 4).map(|i| decode(&leaves, i).1).collect());
        }
    }
    None
}

fn no_hook() -> impl FnMut(Stage) -> Result<(), EchoError> {
    |_| Ok(())
}

fn checkpoint(server: &Server, path: &Path) -> u64 {
    server.checkpoint(path, &example(), None, &mut no_hook()).unwrap()
}

fn restored(path: &Path, backend: BackendConfig) -> Server {
    let opened = OpenedCheckpoint::open(path, Verify::All).unwrap();
    opened.check_example(&example()).unwrap();
    let server = server(backend);
    server.restore(&opened, &descrs()).unwrap();
    server
}

#[test]
fn a_fifo_checkpoint_gives_back_every_sample_not_handed_out_in_order() {
    let dir = tempdir();
    let fifo = BackendConfig::Fifo { batch_size: 4, num_batches: 4 };
    let original = server(fifo.clone());
    insert(&original, 0..10);
    assert_eq!(next_batch(&original), Some(vec![0, 1, 2, 3]));
    let bytes = checkpoint(&original, &dir.join("c"));
    assert!(bytes > 0);
    assert_eq!(original.snapshot().last_checkpoint.bytes, bytes);
    let restored = restored(&dir.join("c"), fifo);
    assert_eq!(next_batch(&restored), Some(vec![4, 5, 6, 7]));
    insert(&restored, 100..102);
    assert_eq!(next_batch(&restored), Some(vec![8, 9, 100, 101]));
}

#[test]
fn a_sequence_checkpoint_restores_its_steps_and_windows() {
    let dir = tempdir();
    let config = BackendConfig::Sequence(
        ReplayConfig { seed: Some(3), ..ReplayConfig::new(2, 64) },
        SequenceConfig::new(3),
    );
    let original = server(config.clone());
    insert(&original, 0..9);
    checkpoint(&original, &dir.join("s"));
    let manifest = OpenedCheckpoint::open(&dir.join("s"), Verify::All).unwrap();
    assert_eq!(manifest.manifest().counts.items, 9);
    let restored = restored(&dir.join("s"), config);
    let batch = next_batch(&restored).expect("a batch of windows");
    // Windows of 3 consecutive steps of the one stream, 2 per batch.
    assert_eq!(batch.len(), 6);
    for window in batch.chunks(3) {
        assert!(window[0] % 3 == 0 && window[1] == window[0] + 1 && window[2] == window[0] + 2);
    }
}

#[test]
fn a_restore_into_a_server_of_another_kind_is_refused() {
    let dir = tempdir();
    let original = server(BackendConfig::Fifo { batch_size: 2, num_batches: 2 });
    insert(&original, 0..2);
    checkpoint(&original, &dir.join("c"));
    let opened = OpenedCheckpoint::open(&dir.join("c"), Verify::All).unwrap();
    let replay = server(BackendConfig::Replay(ReplayConfig::new(2, 8)));
    let err = replay.restore(&opened, &descrs()).unwrap_err().to_string();
    assert!(err.contains("a FIFO ring's checkpoint needs a server of its kind"), "{err}");
}

fn tampered(what: impl FnOnce(&Path)) -> String {
    let dir = tempdir();
    let original = server(BackendConfig::Replay(ReplayConfig::new(2, 8)));
    insert(&original, 0..4);
    checkpoint(&original, &dir.join("c"));
    what(&std::fs::canonicalize(dir.join("c")).unwrap());
    match OpenedCheckpoint::open(&dir.join("c"), Verify::All) {
        Ok(_) => panic!("a tampered checkpoint opened"),
        Err(EchoError::Checkpoint(message)) => message,
        Err(other) => panic!("not a checkpoint error: {other}"),
    }
}

#[test]
fn a_data_file_replaced_by_a_link_or_a_pipe_is_refused_without_reading_it() {
    let to_zero = tampered(|dir| {
        std::fs::remove_file(dir.join("leaf_002.npy")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.join("leaf_002.npy")).unwrap();
    });
    assert!(to_zero.contains("leaf_002.npy: is a symbolic link"), "{to_zero}");
    let outside = tampered(|dir| {
        let elsewhere = dir.parent().unwrap().join("elsewhere.npy");
        std::fs::rename(dir.join("keys.npy"), &elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, dir.join("keys.npy")).unwrap();
    });
    assert!(outside.contains("keys.npy: is a symbolic link"), "{outside}");
    let pipe = tampered(|dir| {
        let file = dir.join("priorities.npy");
        std::fs::remove_file(&file).unwrap();
        let path = std::ffi::CString::new(file.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path; mkfifo only creates the pipe.
        assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    });
    assert!(pipe.contains("priorities.npy: is not a regular file"), "{pipe}");
    let manifest = tampered(|dir| {
        std::fs::remove_file(dir.join("manifest.json")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.join("manifest.json")).unwrap();
    });
    assert!(manifest.contains("manifest.json: is a symbolic link"), "{manifest}");
}

#[test]
fn a_truncated_or_flipped_file_and_a_newer_format_are_named() {
    let truncated = tampered(|dir| {
        let data = std::fs::read(dir.join("leaf_000.npy")).unwrap();
        std::fs::write(dir.join("leaf_000.npy"), &data[..data.len() - 1]).unwrap();
    });
    assert!(
        truncated.contains("leaf_000.npy: ") && truncated.contains("(truncated?)"),
        "{truncated}"
    );
    let flipped = tampered(|dir| {
        let mut data = std::fs::read(dir.join("leaf_001.npy")).unwrap();
        *data.last_mut().unwrap() ^= 1;
        std::fs::write(dir.join("leaf_001.npy"), data).unwrap();
    });
    assert!(
        flipped.contains("leaf_001.npy: SHA-256 ") && flipped.contains("(corrupted)"),
        "{flipped}"
    );
    let newer = tampered(|dir| {
        let text = std::fs::read_to_string(dir.join("manifest.json")).unwrap();
        let text = text.replace("\"format_version\": 3", "\"format_version\": 99");
        std::fs::write(dir.join("manifest.json"), text).unwrap();
    });
    assert!(newer.contains("manifest.json: format version 99 is newer"), "{newer}");
}

#[test]
fn a_failing_hook_abandons_the_checkpoint_and_keeps_the_previous_one() {
    let dir = tempdir();
    let original = server(BackendConfig::Replay(ReplayConfig::new(2, 8)));
    insert(&original, 0..2);
    checkpoint(&original, &dir.join("c"));
    insert(&original, 2..6);
    let mut fail = |stage: Stage| match stage {
        Stage::BeforeSwap => Err(EchoError::Busy("stop".into())),
        _ => Ok(()),
    };
    assert!(original.checkpoint(&dir.join("c"), &example(), None, &mut fail).is_err());
    let opened = OpenedCheckpoint::open(&dir.join("c"), Verify::All).unwrap();
    assert_eq!(opened.manifest().counts.items, 2, "the previous checkpoint stays");
    let entries: Vec<_> =
        std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(entries.len(), 2, "the link and its directory only: {entries:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// A replay table's checkpoint restores every item once, with its priority, whatever the
    /// table's size, how full it is and how often it wrapped.
    #[test]
    fn a_replay_checkpoint_round_trips_every_item(
        max_size in 2usize..24,
        inserts in 0u64..60,
        priorities in proptest::collection::vec(0.5f64..100.0, 60),
    ) {
        let dir = tempdir();
        let config = BackendConfig::Replay(ReplayConfig {
            sampler: echo::replay::SamplerKind::Prioritized { exponent: 1.0 },
            seed: Some(1),
            ..ReplayConfig::new(1, max_size)
        });
        let original = server(config.clone());
        let spec = tagged_spec();
        for seq in 0..inserts {
            let payload = [tagged_payload(0, seq)];
            let source = Payloads::new(&spec, &payload).unwrap();
            let priority = Some(priorities[seq as usize]);
            original.insert(&source, priority, Some(Instant::now() + PATIENCE)).unwrap();
        }
        checkpoint(&original, &dir.join("c"));
        let restored = restored(&dir.join("c"), config);
        let live = inserts.min(max_size as u64);
        let kept: BTreeSet<u64> = (inserts - live..inserts).collect();
        let (echo::backend::BackendStats::Replay(before), echo::backend::BackendStats::Replay(after)) =
            (original.backend().stats(), restored.backend().stats())
        else {
            panic!("replay tables both")
        };
        prop_assert_eq!(before.size, after.size);
        prop_assert_eq!(after.size, live);
        prop_assert_eq!(before.stored_bytes, after.stored_bytes);
        for seq in &kept {
            let key = *seq;
            prop_assert_eq!(restored.backend().priority(key), Some(priorities[key as usize]));
        }
        if live > 0 {
            let got = next_batch(&restored).expect("a batch");
            prop_assert!(got.iter().all(|seq| kept.contains(seq)), "{got:?} not in {kept:?}");
        }
    }
}

/// A new directory under the system's temporary directory, unique to the test (process,
/// thread, time), removed with everything in it when dropped (the property tests make
/// hundreds).
fn tempdir() -> TempDir {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let dir = std::env::temp_dir().join(format!(
        "echo-checkpoint-{}-{:?}-{nanos}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    TempDir(dir)
}

struct TempDir(std::path::PathBuf);

impl std::ops::Deref for TempDir {
    type Target = std::path::Path;

    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::path::Path> for TempDir {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn the_manifest_fuzz_seeds_parse_and_write_back_the_same() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus/checkpoint_manifest");
    let (mut manifests, mut headers) = (0, 0);
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        if path.extension().is_some_and(|e| e == "json") {
            let manifest = echo::checkpoint::Manifest::parse(&bytes)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert_eq!(echo::checkpoint::Manifest::parse(&manifest.to_json()).unwrap(), manifest);
            manifests += 1;
        } else {
            let header = echo::checkpoint::npy::NpyHeader::parse(&bytes).unwrap();
            assert!(header.data_offset <= bytes.len());
            headers += 1;
        }
    }
    assert!(manifests >= 7 && headers >= 2, "the seeds are in {dir}");
}
