//! Large samples read from the socket straight into the FIFO ring (`Link::read_in_place`):
//! mixed with the pooled-buffer path on the same connection, over v1 and v2, with a full
//! ring in between, every sample arrives exactly once, in its producer's order, with every
//! byte in place; a partial sample never reaches the ring.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use common::{assert_exactly_once_in_order, wait_until, PATIENCE};
use echo::backend::Backend;
use echo::ingress::IngressConfig;
use echo::spec::{ArraySpec, DataSpec};
use echo::transport::client::{ClientConfig, Protocol, TcpSender};
use echo::transport::tcp::TcpConfig;
use echo::transport::wire::encode_handshake;
use echo::transport::wire::v2::{FrameMeta, Layout, OFFER_LEN};
use echo::transport::TcpIngress;
use echo::{Consumer, Store};

/// Bytes of the large leaf: odd, so that leaf boundaries fall mid-word in the reads.
const BIG: usize = 40_003;

/// Producer id (u32), sequence number (u64), an empty leaf, `BIG` pattern bytes and 7 more:
/// 40,022 bytes, above the 32 KiB from which samples are read in place.
fn spec() -> DataSpec {
    DataSpec::new(vec![
        ArraySpec::new(vec![], 4).unwrap(),
        ArraySpec::new(vec![], 8).unwrap(),
        ArraySpec::new(vec![0], 4).unwrap(),
        ArraySpec::new(vec![BIG], 1).unwrap(),
        ArraySpec::new(vec![7], 1).unwrap(),
    ])
    .unwrap()
}

fn byte(producer: u32, seq: u64, i: usize) -> u8 {
    (u64::from(producer) * 131 + seq * 17 + i as u64 * 3) as u8
}

fn payload(producer: u32, seq: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + 8 + BIG + 7);
    out.extend_from_slice(&producer.to_le_bytes());
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend((0..BIG + 7).map(|i| byte(producer, seq, i)));
    out
}

fn start(batch_size: usize, num_batches: usize) -> (Consumer, TcpIngress, SocketAddr) {
    let store = Store::new(spec(), batch_size, num_batches).unwrap();
    let consumer = store.consumer().unwrap();
    let tcp = TcpConfig { num_threads: 2, ..TcpConfig::new("127.0.0.1", 0) };
    let ingress = TcpIngress::start(Backend::Fifo(store), IngressConfig::new(2, 8), &tcp).unwrap();
    let addr = ingress.local_addr();
    (consumer, ingress, addr)
}

/// Takes `batches` batches; every sample is checked byte by byte; returns (producer, seq).
fn collect(consumer: &mut Consumer, batches: usize, pause: Duration) -> Vec<(u32, u64)> {
    let mut out = Vec::new();
    for _ in 0..batches {
        consumer.sample(Some(Instant::now() + PATIENCE)).expect("batch did not arrive");
        let leaves: Vec<Vec<u8>> = (0..5).map(|l| consumer.read_leaf(l, <[u8]>::to_vec)).collect();
        for i in 0..consumer.store().batch_size() {
            let producer = u32::from_le_bytes(leaves[0][i * 4..i * 4 + 4].try_into().unwrap());
            let seq = u64::from_le_bytes(leaves[1][i * 8..i * 8 + 8].try_into().unwrap());
            let big = &leaves[3][i * BIG..(i + 1) * BIG];
            let tail = &leaves[4][i * 7..(i + 1) * 7];
            let intact =
                big.iter().chain(tail).enumerate().all(|(j, &b)| b == byte(producer, seq, j));
            assert!(intact, "sample ({producer}, {seq}) is corrupted");
            out.push((producer, seq));
        }
        thread::sleep(pause);
    }
    out
}

fn sender(addr: SocketAddr, protocol: Protocol) -> TcpSender {
    let config = ClientConfig {
        max_inflight: 16,
        protocol,
        ..ClientConfig::new("127.0.0.1", addr.port(), Layout::untyped(&spec()))
    };
    TcpSender::connect(config, PATIENCE).unwrap()
}

/// `producers` threads (v1 and v2 alternately) each send `per_producer` samples, pausing
/// `every`-th sample for `gap` (so some arrive whole into an idle connection).
fn send_all(addr: SocketAddr, producers: u32, per_producer: u64, gap: Duration) {
    let handles: Vec<_> = (0..producers)
        .map(|producer| {
            thread::spawn(move || {
                let protocol = if producer % 2 == 1 { Protocol::V1 } else { Protocol::Auto };
                let mut client = sender(addr, protocol);
                for seq in 0..per_producer {
                    let p = payload(producer, seq);
                    let leaves = [&p[..4], &p[4..12], &p[12..12], &p[12..12 + BIG], &p[12 + BIG..]];
                    client
                        .send(&leaves, FrameMeta::default(), Some(Instant::now() + PATIENCE))
                        .unwrap();
                    if seq % 8 == 0 {
                        thread::sleep(gap);
                    }
                }
                assert!(client.close(Some(Instant::now() + PATIENCE)), "close did not flush");
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap();
    }
}

#[test]
fn large_samples_go_in_place_or_pooled_exactly_once_in_order_and_intact() {
    const PRODUCERS: u32 = 6;
    const PER_PRODUCER: u64 = 160;
    let (mut consumer, server, addr) = start(4, 16);
    let senders =
        thread::spawn(move || send_all(addr, PRODUCERS, PER_PRODUCER, Duration::from_millis(2)));
    let batches = (u64::from(PRODUCERS) * PER_PRODUCER / 4) as usize;
    let got = collect(&mut consumer, batches, Duration::ZERO);
    senders.join().unwrap();
    assert_exactly_once_in_order(&got, PRODUCERS, PER_PRODUCER);
    let snap = server.snapshot();
    assert_eq!(snap.samples_inserted_total, u64::from(PRODUCERS) * PER_PRODUCER);
    // Samples sent into an idle connection arrive whole (one write each): some go in place.
    assert!(snap.samples_received_in_place_total > 0, "{snap:?}");
    assert!(snap.samples_received_in_place_total < snap.samples_inserted_total, "{snap:?}");
}

#[test]
fn a_full_ring_sends_samples_through_the_queue_and_order_holds_when_it_frees() {
    const PRODUCERS: u32 = 3;
    const PER_PRODUCER: u64 = 120;
    // Two batches of two: the ring is full most of the time, as the consumer dawdles.
    let (mut consumer, server, addr) = start(2, 2);
    let senders = thread::spawn(move || send_all(addr, PRODUCERS, PER_PRODUCER, Duration::ZERO));
    let batches = (u64::from(PRODUCERS) * PER_PRODUCER / 2) as usize;
    let got = collect(&mut consumer, batches, Duration::from_micros(300));
    senders.join().unwrap();
    assert_exactly_once_in_order(&got, PRODUCERS, PER_PRODUCER);
    let snap = server.snapshot();
    assert_eq!(snap.samples_inserted_total, u64::from(PRODUCERS) * PER_PRODUCER);
    assert!(snap.push_blocked_count > 0, "the ring never filled: {snap:?}");
}

#[test]
fn whole_samples_in_one_burst_arrive_and_the_partial_one_after_them_never_does() {
    let (mut consumer, server, addr) = start(1, 8);
    let mut raw = TcpStream::connect(addr).unwrap();
    let mut greeting = vec![0u8; encode_handshake(&spec()).unwrap().len() + OFFER_LEN];
    raw.read_exact(&mut greeting).unwrap();
    let mut burst: Vec<u8> = (0..3).flat_map(|seq| payload(9, seq)).collect();
    burst.extend_from_slice(&payload(9, 3)[..20_000]);
    raw.write_all(&burst).unwrap();
    let mut acks = [0u8; 3];
    raw.read_exact(&mut acks).unwrap();
    assert_eq!(acks, [1, 1, 1]);
    drop(raw); // mid-sample
    let got = collect(&mut consumer, 3, Duration::ZERO);
    assert_eq!(got, vec![(9, 0), (9, 1), (9, 2)]);
    wait_until("the connection ended", || server.snapshot().active_connections == 0);
    thread::sleep(Duration::from_millis(50));
    let store = consumer.store();
    assert_eq!(store.stats().write_cursor, 3, "the partial sample reached the ring");
}
