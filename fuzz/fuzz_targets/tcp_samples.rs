//! The server's sample splitting, end to end: a client writes a byte stream to the real
//! `TcpServer` + `Ingress` + FIFO `Store` over loopback, in the chunks the input says, then
//! closes its side. There is no framing on the wire (a sample is `payload_size` raw bytes), so
//! the server's whole job is to cut the stream into exact-size samples:
//!
//! - the server sends the handshake of its spec first, then its offer of wire v2 (which a v1
//!   client skips; it holds no `ACK` byte);
//! - every whole sample is acknowledged with exactly one `ACK` byte, and nothing else comes
//!   back before the server closes the connection (it must close, partial tail or not);
//! - every whole sample reaches the store exactly once, in order and intact (each input's
//!   stream is a fresh pseudo-random pattern, so a shifted, torn, stale or duplicated sample
//!   is caught), and the partial tail never does.
//!
//! The input picks one of a few specs (one server each, started on first use and kept for
//! the whole run: payloads of 1 to 100 000 bytes, around the server's 64 KiB staging buffer
//! and its direct-read threshold) and a list of write sizes, in bytes or in samples plus or
//! minus a few bytes. Queues of 32 and a ring of 3 batches of 32 keep backpressure in play.
//! After each input the last batch is completed with filler samples inserted directly, so the
//! consumer hands out everything and the next input starts on a batch boundary.
//! Each input is bounded (256 KiB, 256 samples) and every wait has a deadline (the drainers
//! have no idle wake-up either): a lost or extra sample, a lost wake-up or a connection the
//! server never closes is a crash, not a hang.
#![no_main]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use echo::backend::Backend;
use echo::ingress::IngressConfig;
use echo::transport::tcp::TcpConfig;
use echo::transport::wire::v2::OFFER_LEN;
use echo::transport::wire::{encode_handshake, ACK};
use echo::transport::TcpIngress;
use echo::{ArraySpec, DataSpec, Payloads, Store};
use libfuzzer_sys::fuzz_target;

/// Leaves (element count, dtype size) of each spec the input may pick. Payload sizes 1, 7
/// (an empty leaf first), 25, 1000, 32 768 (a whole sample is exactly half the staging
/// buffer: read directly), 40 000 (direct reads, then the tail through staging), 100 000 (more
/// than the staging buffer).
const SPECS: [&[(usize, usize)]; 7] = [
    &[(1, 1)],
    &[(0, 4), (1, 4), (3, 1)],
    &[(1, 4), (1, 8), (13, 1)],
    &[(250, 4)],
    &[(4096, 8)],
    &[(10_000, 2), (5_000, 4)],
    &[(1, 8), (24_998, 4)],
];
const MAX_STREAM: usize = 256 * 1024;
const MAX_SAMPLES: usize = 256;
const PATIENCE: Duration = Duration::from_secs(20);
/// Samples per store batch.
const BATCH: usize = 32;

#[derive(Debug, Arbitrary)]
struct Input {
    spec: u8,
    writes: Vec<Chunk>,
}

/// One `write_all` of the client.
#[derive(Debug, Arbitrary)]
enum Chunk {
    Bytes(u16),
    /// `samples * payload_size + delta` bytes (at least 1).
    Samples {
        samples: u8,
        delta: i8,
    },
}

/// One server and the consumer thread that forwards every batch it takes.
struct Harness {
    addr: SocketAddr,
    handshake: Vec<u8>,
    spec: DataSpec,
    store: Arc<Store>,
    /// Batches from the consumer thread, each as its samples' payloads.
    batches: Mutex<Receiver<Vec<Vec<u8>>>>,
    /// Samples put in the store so far (stream and filler), over all inputs.
    inserted: AtomicU64,
    _server: TcpIngress,
}

fn harness(index: usize) -> &'static Harness {
    static HARNESSES: [OnceLock<Harness>; SPECS.len()] = [const { OnceLock::new() }; SPECS.len()];
    HARNESSES[index].get_or_init(|| {
        let leaves: Vec<ArraySpec> = SPECS[index]
            .iter()
            .map(|&(n, dtype)| ArraySpec::new(vec![n], dtype).unwrap())
            .collect();
        let spec = DataSpec::new(leaves).unwrap();
        let handshake = encode_handshake(&spec).unwrap();
        let store = Store::new(spec.clone(), BATCH, 3).unwrap();
        let mut consumer = store.consumer().unwrap();
        let tcp =
            TcpConfig { num_threads: 1, max_connections: 64, ..TcpConfig::new("127.0.0.1", 0) };
        // No idle wake-up: a lost wake-up hangs, and the deadlines below turn that into a crash.
        let mut ingress = IngressConfig::new(1, 32);
        ingress.idle_park = None;
        let server = TcpIngress::start(Backend::Fifo(Arc::clone(&store)), ingress, &tcp).unwrap();
        let (tx, rx) = mpsc::channel();
        let layout = spec.clone();
        thread::Builder::new()
            .name(format!("consumer-{index}"))
            .spawn(move || {
                while consumer.sample(None).is_ok() {
                    let mut batch: Vec<Vec<u8>> =
                        (0..BATCH).map(|_| Vec::with_capacity(layout.payload_size())).collect();
                    for (leaf, array) in layout.arrays().iter().enumerate() {
                        let n = array.num_bytes();
                        consumer.read_leaf(leaf, |bytes| {
                            for (i, sample) in batch.iter_mut().enumerate() {
                                sample.extend_from_slice(&bytes[i * n..(i + 1) * n]);
                            }
                        });
                    }
                    if tx.send(batch).is_err() {
                        return;
                    }
                }
            })
            .unwrap();
        Harness {
            addr: server.local_addr(),
            handshake,
            spec,
            store,
            batches: Mutex::new(rx),
            inserted: AtomicU64::new(0),
            _server: server,
        }
    })
}

/// A pseudo-random stream, different for every input (splitmix64 of a per-run counter and
/// the word index), so no two samples anywhere look alike.
fn stream(len: usize) -> Vec<u8> {
    static INPUTS: AtomicU64 = AtomicU64::new(0);
    // ORDERING: Relaxed — a counter of the fuzzing thread's own; it guards nothing.
    let seed = INPUTS.fetch_add(1, Relaxed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut out = Vec::with_capacity(len + 8);
    for word in 0..len.div_ceil(8) as u64 {
        let mut z = seed.wrapping_add(word.wrapping_mul(0xD1B5_4A32_D192_ED03));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

fuzz_target!(|input: Input| {
    let h = harness(usize::from(input.spec) % SPECS.len());
    let p = h.spec.payload_size();
    let limit = MAX_STREAM.min(MAX_SAMPLES * p + p - 1);
    let mut writes = Vec::new();
    let mut len = 0usize;
    for w in &input.writes {
        let n = match *w {
            Chunk::Bytes(n) => usize::from(n),
            Chunk::Samples { samples, delta } => {
                (usize::from(samples) * p).saturating_add_signed(isize::from(delta)).max(1)
            }
        };
        let n = n.min(limit - len);
        if n > 0 {
            writes.push(n);
            len += n;
        }
    }
    let data = stream(len);
    let whole = len / p;

    let mut conn = TcpStream::connect(h.addr).expect("connect");
    conn.set_nodelay(true).unwrap();
    conn.set_read_timeout(Some(PATIENCE)).unwrap();
    conn.set_write_timeout(Some(PATIENCE)).unwrap();
    let mut handshake = vec![0u8; h.handshake.len()];
    conn.read_exact(&mut handshake).expect("handshake");
    assert_eq!(handshake, h.handshake);
    let mut offer = [0u8; OFFER_LEN];
    conn.read_exact(&mut offer).expect("offer");
    assert!(offer.starts_with(b"ECHO\x02o") && !offer.contains(&ACK), "{offer:?}");

    // The acks (one byte per sample, at most MAX_SAMPLES) fit in the socket buffer, so the
    // server never blocks on them and one thread can write everything before reading them.
    let mut at = 0;
    for &n in &writes {
        conn.write_all(&data[at..at + n]).expect("writing the stream");
        at += n;
    }
    conn.shutdown(Shutdown::Write).unwrap();
    // The server must close the connection once it has read our EOF.
    let mut acks = Vec::new();
    conn.read_to_end(&mut acks).expect("the server did not close the connection");
    assert_eq!(acks.len(), whole, "acks for {len} bytes of {p}-byte samples");
    assert!(acks.iter().all(|&b| b == ACK), "a byte other than ACK came back");

    // Wait until the drainer has put every acked sample in the store, then complete the last
    // batch with filler samples (zeros; the stream is pseudo-random) inserted directly, so
    // that the consumer hands it out and no sample is left over for the next input.
    // ORDERING: Relaxed — only the fuzzing thread touches `inserted`.
    let before = h.inserted.load(Relaxed);
    let streamed = before + whole as u64;
    let deadline = Instant::now() + PATIENCE;
    while h.store.stats().write_cursor < streamed {
        assert!(Instant::now() < deadline, "acked samples never reached the store");
        thread::yield_now();
    }
    let pad = (BATCH - (streamed % BATCH as u64) as usize) % BATCH;
    let filler = vec![0u8; p];
    let fillers = vec![&filler[..]; pad];
    h.store
        .insert(&Payloads::new(&h.spec, &fillers).unwrap(), Some(deadline))
        .expect("inserting filler samples");
    let total = streamed + pad as u64;
    // ORDERING: Relaxed — as above.
    h.inserted.store(total, Relaxed);
    assert_eq!(h.store.stats().write_cursor, total, "samples in the store that were not sent");

    // Earlier inputs ended on whole batches, so this input's samples start a batch.
    let rx = h.batches.lock().unwrap();
    let mut got = 0;
    while got < whole + pad {
        let batch = rx
            .recv_timeout(PATIENCE)
            .unwrap_or_else(|_| panic!("sample {got} of {whole} (+{pad} filler) never arrived"));
        for sample in batch {
            let expected = if got < whole { &data[got * p..(got + 1) * p] } else { &filler[..] };
            assert!(
                sample == expected,
                "sample {got} of {whole} (+{pad} filler, {p} bytes) differs"
            );
            got += 1;
        }
    }
    assert_eq!(got, whole + pad, "batches overran this input's samples");
    assert!(rx.try_recv().is_err(), "a batch nobody sent");
});
