//! Helpers shared by the integration tests: a sample layout that encodes who wrote a sample
//! and in which order, so consumers can check exactly-once, in-order, uncorrupted delivery,
//! and the FIFO TCP server, the client and the reading side that the transport tests share.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use echo::backend::Backend;
use echo::ingress::IngressConfig;
use echo::transport::client::{ClientConfig, TcpSender};
use echo::transport::tcp::TcpConfig;
use echo::transport::wire::v2::{self, FrameMeta, Layout, Offer, Reply};
use echo::transport::TcpIngress;
use echo::{ArraySpec, Consumer, DataSpec, EchoError, Store};

/// Long enough for any healthy wait on a loaded 2-core machine; a deadlock or a lost
/// wake-up runs into it and fails the test instead of hanging it.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// Polls `done` (1 ms apart) until it holds; panics naming `what` after [`PATIENCE`]. How a
/// test waits for another thread to reach a state (a count of parked threads, a counter),
/// instead of sleeping and hoping it got there.
pub fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not reached within {PATIENCE:?}");
        thread::sleep(Duration::from_millis(1));
    }
}

/// Leaf 0: producer id (u32). Leaf 1: sequence number (u64). Leaf 2: 13 bytes derived from
/// both (an odd size, to catch misaligned or torn copies).
pub fn tagged_spec() -> DataSpec {
    DataSpec::new(vec![
        ArraySpec::new(vec![], 4).unwrap(),
        ArraySpec::new(vec![], 8).unwrap(),
        ArraySpec::new(vec![13], 1).unwrap(),
    ])
    .unwrap()
}

pub const TAGGED_PAYLOAD: usize = 4 + 8 + 13;

/// The payload of sample `seq` from `producer` in the wire layout of [`tagged_spec`].
pub fn tagged_payload(producer: u32, seq: u64) -> [u8; TAGGED_PAYLOAD] {
    let mut out = [0u8; TAGGED_PAYLOAD];
    out[..4].copy_from_slice(&producer.to_le_bytes());
    out[4..12].copy_from_slice(&seq.to_le_bytes());
    for (i, byte) in out[12..].iter_mut().enumerate() {
        *byte = pattern(producer, seq, i);
    }
    out
}

pub fn pattern(producer: u32, seq: u64, i: usize) -> u8 {
    (producer as u64).wrapping_mul(31).wrapping_add(seq.wrapping_mul(7)).wrapping_add(i as u64)
        as u8
}

/// Decodes sample `i` of a batch given the three leaves' bytes; panics on a corrupted sample.
pub fn decode(leaves: &[Vec<u8>; 3], i: usize) -> (u32, u64) {
    let producer = u32::from_le_bytes(leaves[0][i * 4..i * 4 + 4].try_into().unwrap());
    let seq = u64::from_le_bytes(leaves[1][i * 8..i * 8 + 8].try_into().unwrap());
    let tail = &leaves[2][i * 13..i * 13 + 13];
    for (j, &b) in tail.iter().enumerate() {
        assert_eq!(b, pattern(producer, seq, j), "sample ({producer}, {seq}) is corrupted");
    }
    (producer, seq)
}

/// Checks that `got` (producer, seq) holds every producer's `0..per_producer` exactly once and
/// in order (producers interleaved any way).
pub fn assert_exactly_once_in_order(got: &[(u32, u64)], producers: u32, per_producer: u64) {
    let mut next = vec![0u64; producers as usize];
    for &(p, s) in got {
        assert_eq!(s, next[p as usize], "producer {p}: lost, duplicated or reordered");
        next[p as usize] += 1;
    }
    assert!(next.iter().all(|&n| n == per_producer), "missing samples: {next:?}");
}

/// A FIFO store of [`tagged_spec`] samples (`num_batches` batches of `batch_size`) fed by a
/// TCP ingress started with `tcp` (2 drainers, connection queues of `queue_size`): its
/// consumer, the ingress and the address it listens on.
pub fn start_tagged_fifo(
    tcp: &TcpConfig,
    batch_size: usize,
    num_batches: usize,
    queue_size: usize,
) -> (Consumer, TcpIngress, SocketAddr) {
    let store = Store::new(tagged_spec(), batch_size, num_batches).unwrap();
    let consumer = store.consumer().unwrap();
    let ingress =
        TcpIngress::start(Backend::Fifo(store.clone()), IngressConfig::new(2, queue_size), tcp)
            .unwrap();
    let addr = ingress.local_addr();
    (consumer, ingress, addr)
}

/// A client configuration for [`tagged_spec`] samples to 127.0.0.1:`port`.
pub fn tagged_client(port: u16) -> ClientConfig {
    ClientConfig::new("127.0.0.1", port, Layout::untyped(&tagged_spec()))
}

/// Sends sample `seq` of `producer` (its three leaves), waiting at most [`PATIENCE`].
pub fn send_tagged(client: &mut TcpSender, producer: u32, seq: u64) -> Result<(), EchoError> {
    let p = tagged_payload(producer, seq);
    client.send(
        &[&p[..4], &p[4..12], &p[12..]],
        FrameMeta::default(),
        Some(Instant::now() + PATIENCE),
    )
}

/// Takes `batches` batches and returns every (producer, seq) in arrival order, each sample
/// checked whole by [`decode`].
pub fn collect_tagged(consumer: &mut Consumer, batches: usize) -> Vec<(u32, u64)> {
    let mut out = Vec::new();
    for _ in 0..batches {
        consumer.sample(Some(Instant::now() + PATIENCE)).expect("batch did not arrive");
        let leaves = batch_leaves(consumer);
        for i in 0..consumer.store().batch_size() {
            out.push(decode(&leaves, i));
        }
    }
    out
}

/// Samples per writer of a stress test: `ECHO_STRESS_COUNT` when set (valgrind runs set a
/// small one), else `debug` or `release` by the build.
pub fn stress_count(debug: u64, release: u64) -> u64 {
    std::env::var("ECHO_STRESS_COUNT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if cfg!(debug_assertions) { debug } else { release })
}

/// The three leaves of the consumer's current batch of [`tagged_spec`] samples, copied.
pub fn batch_leaves(consumer: &Consumer) -> [Vec<u8>; 3] {
    std::array::from_fn(|l| consumer.read_leaf(l, <[u8]>::to_vec))
}

/// Starts one thread per producer `0..producers`, each running `write(store, producer)` with
/// its own handle to `store`.
pub fn spawn_writers(
    store: &Arc<Store>,
    producers: u32,
    write: impl Fn(Arc<Store>, u32) + Clone + Send + 'static,
) -> Vec<thread::JoinHandle<()>> {
    (0..producers)
        .map(|producer| {
            let (store, write) = (store.clone(), write.clone());
            thread::spawn(move || write(store, producer))
        })
        .collect()
}

/// An untokened hello for the tagged layout, of session `[session; 16]`, with the flags
/// given: shared memory wanted, closing notices and codecs understood.
pub fn tagged_hello(session: u8, shm: bool, notices: bool, codecs: bool) -> v2::Hello {
    v2::Hello {
        session: [session; 16],
        first_seq: 0,
        heartbeat_ms: 0,
        client_nonce: [4; 16],
        layout: Layout::untyped(&tagged_spec()),
        mac: None,
        shm,
        notices,
        codecs,
        durable: false,
        params: false,
        versions: false,
    }
}

/// A raw connection to a server of `spec` that said `hello` and read the reply.
pub fn raw_client_of(
    addr: SocketAddr,
    spec: &DataSpec,
    hello: v2::Hello,
) -> (TcpStream, v2::Accept) {
    use echo::transport::wire::encode_handshake;
    let mut raw = TcpStream::connect(addr).unwrap();
    raw.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut greeting = vec![0u8; encode_handshake(spec).unwrap().len() + v2::OFFER_LEN];
    raw.read_exact(&mut greeting).unwrap();
    let offer = Offer::parse(&greeting[greeting.len() - v2::OFFER_LEN..]).unwrap().unwrap();
    raw.write_all(&hello.encode(&offer, None).unwrap()).unwrap();
    let mut reply = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        raw.read_exact(&mut byte).unwrap();
        reply.push(byte[0]);
        if let Some((reply, _)) = Reply::parse(&reply).unwrap() {
            match reply {
                Reply::Accepted(accept) => return (raw, accept),
                other => panic!("refused: {other:?}"),
            }
        }
    }
}
