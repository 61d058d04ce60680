//! Checkpoint stall in the core, without Python's GIL in the way: the worst and
//! p99 latency of single-item inserts and of `sample()` under a steady producer thread and
//! consumer thread, without and with checkpoints written back to back (`.npy` files, hashed
//! and fsynced, as `Server.checkpoint` writes them), for a replay table and for the FIFO ring.
//!
//! `cargo bench --bench checkpoint_stall -- [--items 1000000] [--bytes 1024] [--seconds 5]
//! [--dir /tmp] [--chunk 1048576] [--only replay|fifo]` (the defaults are the target
//! size: a 1e6-item, ~1 GiB table).
//! `python -m benches checkpoint-stall` measures the same through Python, where the GIL
//! adds its own stalls.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use echo::backend::FifoSnapshot;
use echo::checkpoint::{write_leaf_files_chunked, Chunks, LeafFile};
use echo::queued::QueuedSamples;
use echo::replay::{ReplayConfig, SamplerKind, Table};
use echo::{ArraySpec, DataSpec, Leaves, Rows, Store};

struct Args {
    chunk: usize,
    only: String,
    items: usize,
    bytes: usize,
    seconds: f64,
    dir: PathBuf,
}

fn args() -> Args {
    let mut out = Args {
        chunk: echo::checkpoint::CHUNK_BYTES,
        only: String::new(),
        items: 1_000_000,
        bytes: 1024,
        seconds: 5.0,
        dir: std::env::temp_dir(),
    };
    let argv: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i < argv.len() {
        let value = argv.get(i + 1).cloned().unwrap_or_default();
        match argv[i].as_str() {
            "--items" => out.items = value.parse().expect("--items N"),
            "--bytes" => out.bytes = value.parse().expect("--bytes N"),
            "--seconds" => out.seconds = value.parse().expect("--seconds S"),
            "--dir" => out.dir = PathBuf::from(value),
            "--chunk" => out.chunk = value.parse().expect("--chunk BYTES"),
            "--only" => out.only = value,
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    out
}

#[derive(Default)]
struct Latencies {
    inserts: Vec<Duration>,
    samples: Vec<Duration>,
}

fn summary(mut xs: Vec<Duration>) -> String {
    if xs.is_empty() {
        return "-".into();
    }
    xs.sort_unstable();
    let p99 = xs[(xs.len() - 1) * 99 / 100];
    format!(
        "p99 {:.3} ms max {:.3} ms (n={})",
        p99.as_secs_f64() * 1e3,
        xs[xs.len() - 1].as_secs_f64() * 1e3,
        xs.len()
    )
}

/// A deadline that ends a phase's last call once the other side stopped (a full ring, an
/// empty table); a call that times out is not counted.
fn soon() -> Instant {
    Instant::now() + Duration::from_secs(1)
}

fn files(dir: &Path, bytes: usize) -> Vec<LeafFile> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    vec![LeafFile {
        path: dir.join("leaf_000.npy"),
        descr: "'|u1'".into(),
        shape: vec![bytes],
        raw: false,
    }]
}

/// Runs `insert` and `sample` on two threads for `seconds`; the calling thread runs
/// `checkpoint` back to back if given. Returns the latencies and the checkpoints' durations.
fn phase(
    seconds: f64,
    insert: impl Fn() -> bool + Send + 'static,
    sample: impl FnMut() -> bool + Send + 'static,
    mut checkpoint: Option<&mut dyn FnMut()>,
) -> (Latencies, Vec<Duration>) {
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let stop = Arc::clone(&stop);
        thread::spawn(move || {
            let mut out = Vec::new();
            while !stop.load(Relaxed) {
                let t = Instant::now();
                if insert() {
                    out.push(t.elapsed());
                }
            }
            out
        })
    };
    let consumer = {
        let stop = Arc::clone(&stop);
        let mut sample = sample;
        thread::spawn(move || {
            let mut out = Vec::new();
            while !stop.load(Relaxed) {
                let t = Instant::now();
                if sample() {
                    out.push(t.elapsed());
                }
            }
            out
        })
    };
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    let mut took = Vec::new();
    while Instant::now() < end {
        match checkpoint.as_mut() {
            Some(run) => {
                let t = Instant::now();
                run();
                took.push(t.elapsed());
            }
            None => thread::sleep(Duration::from_millis(20)),
        }
    }
    stop.store(true, Relaxed);
    let inserts = producer.join().unwrap();
    let samples = consumer.join().unwrap();
    (Latencies { inserts, samples }, took)
}

fn report(name: &str, lat: Latencies, took: &[Duration]) {
    let ckpt = if took.is_empty() {
        String::new()
    } else {
        let max = took.iter().max().unwrap().as_secs_f64();
        format!(" | {} checkpoints, longest {max:.2} s", took.len())
    };
    println!(
        "  {name:>13}: insert {} | sample {}{ckpt}",
        summary(lat.inserts),
        summary(lat.samples)
    );
}

fn replay(args: &Args) {
    let spec = DataSpec::new(vec![ArraySpec::new(vec![args.bytes], 1).unwrap()]).unwrap();
    let mut config = ReplayConfig::new(32, args.items);
    config.sampler = SamplerKind::Uniform;
    config.seed = Some(0);
    let table = Table::new(spec.clone(), config).unwrap();
    let block = vec![0u8; args.bytes * 10_000];
    let mut left = args.items;
    while left > 0 {
        let n = left.min(10_000);
        let leaves = [&block[..n * args.bytes]];
        table.insert(&Rows::new(&spec, &leaves, n, None).unwrap(), None, None).unwrap();
        left -= n;
    }
    println!(
        "replay table: {} items x {} B = {:.0} MiB",
        args.items,
        args.bytes,
        (args.items * args.bytes) as f64 / 1048576.0
    );
    let row = vec![1u8; args.bytes];
    let make_insert = |table: Arc<Table>, row: Vec<u8>| {
        move || table.insert(&Leaves(&[&row[..]]), None, Some(soon())).is_ok()
    };
    // One consumer for the table's life: handed from phase to phase.
    let consumer = Arc::new(parking_lot::Mutex::new(table.consumer().unwrap()));
    let sampler = |consumer: Arc<parking_lot::Mutex<echo::replay::ReplayConsumer>>| {
        move || consumer.lock().sample(Some(soon())).is_ok()
    };
    let (lat, took) = phase(
        args.seconds,
        make_insert(Arc::clone(&table), row.clone()),
        sampler(Arc::clone(&consumer)),
        None,
    );
    report("no checkpoint", lat, &took);
    let dir = args.dir.join("echo-checkpoint-stall-replay");
    let mut run = || {
        let files = files(&dir, args.bytes);
        let mut checkpoint = table.checkpoint().unwrap();
        write_leaf_files_chunked(&mut checkpoint, &files, args.chunk).unwrap();
    };
    let (lat, took) = phase(
        args.seconds,
        make_insert(Arc::clone(&table), row),
        sampler(consumer),
        Some(&mut run),
    );
    report("checkpoints", lat, &took);
    let _ = std::fs::remove_dir_all(&dir);
    table.close();
}

fn fifo(args: &Args) {
    let spec = DataSpec::new(vec![ArraySpec::new(vec![args.bytes], 1).unwrap()]).unwrap();
    // A ring of about the same bytes as the table, in batches of 32.
    let num_batches = (args.items / 32).max(2);
    let store = Store::new(spec, 32, num_batches).unwrap();
    println!("FIFO ring: {num_batches} batches of 32 x {} B", args.bytes);
    let consumer = Arc::new(parking_lot::Mutex::new(store.consumer().unwrap()));
    let row = vec![1u8; args.bytes];
    let insert = |store: Arc<Store>, row: Vec<u8>| {
        move || store.insert(&Leaves(&[&row[..]]), Some(soon())).is_ok()
    };
    let sample = |consumer: Arc<parking_lot::Mutex<echo::Consumer>>| {
        move || {
            let ok = consumer.lock().sample(Some(soon())).is_ok();
            // A learner's step: the producer keeps the ring near full.
            thread::sleep(Duration::from_micros(200));
            ok
        }
    };
    let (lat, took) = phase(
        args.seconds,
        insert(Arc::clone(&store), row.clone()),
        sample(Arc::clone(&consumer)),
        None,
    );
    report("no checkpoint", lat, &took);
    let dir = args.dir.join("echo-checkpoint-stall-fifo");
    let mut rows = 0;
    let mut run = || {
        let files = files(&dir, args.bytes);
        let (ring, ()) = store.checkpoint_with(|| ()).unwrap();
        let mut snapshot = FifoSnapshot::new(ring, QueuedSamples::new(args.bytes));
        rows = rows.max(snapshot.len());
        write_leaf_files_chunked(&mut snapshot, &files, args.chunk).unwrap();
    };
    let (lat, took) =
        phase(args.seconds, insert(Arc::clone(&store), row), sample(consumer), Some(&mut run));
    report("checkpoints", lat, &took);
    println!("  (largest FIFO checkpoint: {rows} samples)");
    let _ = std::fs::remove_dir_all(&dir);
    store.close();
}

fn main() {
    let args = args();
    println!(
        "echo core checkpoint stall, {} CPUs, {} s per phase",
        thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
        args.seconds
    );
    println!("chunks of {} bytes", args.chunk);
    if args.only != "fifo" {
        replay(&args);
    }
    if args.only != "replay" {
        fifo(&args);
    }
}
