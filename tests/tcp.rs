//! The TCP path over real loopback sockets: handshake bytes, exactly-once delivery from many
//! concurrent clients, partial samples, backpressure, acked-then-closed clients, connection
//! limits and shutdown with live connections.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::{
    assert_exactly_once_in_order, collect_tagged, send_tagged, start_tagged_fifo, tagged_client,
    tagged_payload, tagged_spec, wait_until, PATIENCE,
};
use echo::backend::Backend;
use echo::ingress::IngressConfig;
use echo::transport::client::{ClientConfig, Protocol, TcpSender};
use echo::transport::tcp::TcpConfig;
use echo::transport::wire::encode_handshake;
use echo::transport::wire::v2::{FrameMeta, Layout, OFFER_LEN};
use echo::transport::TcpIngress;
use echo::{Consumer, EchoError, Store};

fn start(
    batch_size: usize,
    num_batches: usize,
    queue_size: usize,
    max_connections: usize,
) -> (Consumer, TcpIngress, SocketAddr) {
    let tcp = TcpConfig { num_threads: 2, max_connections, ..TcpConfig::new("127.0.0.1", 0) };
    start_tagged_fifo(&tcp, batch_size, num_batches, queue_size)
}

fn client_config(port: u16, max_inflight: u64, protocol: Protocol) -> ClientConfig {
    ClientConfig { max_inflight, protocol, ..tagged_client(port) }
}

fn connect(addr: SocketAddr, max_inflight: u64) -> TcpSender {
    connect_with(addr, max_inflight, Protocol::Auto)
}

fn connect_with(addr: SocketAddr, max_inflight: u64, protocol: Protocol) -> TcpSender {
    TcpSender::connect(client_config(addr.port(), max_inflight, protocol), PATIENCE).unwrap()
}

/// Starts `producers` threads that each connect, send `per_producer` tagged samples in order
/// and close; each returns whether its close flushed every ack.
fn spawn_senders(
    addr: SocketAddr,
    producers: u32,
    per_producer: u64,
    max_inflight: u64,
) -> Vec<thread::JoinHandle<bool>> {
    let send_all = move |producer: u32| {
        // Odd producers speak v1 (as id-echo 0.2.1), even ones negotiate v2: both at once.
        let protocol = if producer % 2 == 1 { Protocol::V1 } else { Protocol::Auto };
        let mut client = connect_with(addr, max_inflight, protocol);
        assert_eq!(client.protocol(), if producer % 2 == 1 { 1 } else { 2 });
        for seq in 0..per_producer {
            send_tagged(&mut client, producer, seq).unwrap();
        }
        client.close(Some(Instant::now() + PATIENCE))
    };
    (0..producers).map(|producer| thread::spawn(move || send_all(producer))).collect()
}

#[test]
fn the_greeting_is_the_v1_handshake_then_a_v2_offer_without_ack_bytes() {
    let (_consumer, _server, addr) = start(4, 2, 8, 16);
    let mut raw = TcpStream::connect(addr).unwrap();
    let expected = encode_handshake(&tagged_spec()).unwrap();
    let mut got = vec![0u8; expected.len() + OFFER_LEN];
    raw.read_exact(&mut got).unwrap();
    assert_eq!(got[..expected.len()], expected[..]);
    assert_eq!(&got[..5], b"ECHO\x01");
    assert_eq!(u32::from_le_bytes(got[5..9].try_into().unwrap()), 3);
    let offer = &got[expected.len()..];
    assert_eq!(&offer[..6], b"ECHO\x02o");
    // A v1 client counts 0x01 bytes as acks: the offer must hold none.
    assert!(!offer.contains(&1), "{offer:?}");
}

#[test]
fn thirty_two_concurrent_clients_deliver_exactly_once_in_order() {
    const CLIENTS: u32 = 32;
    const PER_CLIENT: u64 = 2_000;
    let (mut consumer, mut server, addr) = start(64, 4, 8, 64);
    let senders = spawn_senders(addr, CLIENTS, PER_CLIENT, 32);
    let total = CLIENTS as usize * PER_CLIENT as usize;
    let got = collect_tagged(&mut consumer, total / 64);
    assert_exactly_once_in_order(&got, CLIENTS, PER_CLIENT);
    for s in senders {
        assert!(s.join().unwrap(), "close() did not flush");
    }
    // The drainer counts a round after its insert returns, so the count can trail the batch.
    wait_until(&format!("samples_inserted_total reaching {total}"), || {
        server.snapshot().samples_inserted_total >= total as u64
    });
    assert_eq!(server.snapshot().samples_inserted_total, total as u64);
    server.shutdown();
}

#[test]
fn a_partial_sample_is_discarded_and_never_misaligns_the_ring() {
    let (mut consumer, _server, addr) = start(2, 2, 8, 16);
    let mut raw = TcpStream::connect(addr).unwrap();
    let mut hs = vec![0u8; encode_handshake(&tagged_spec()).unwrap().len() + OFFER_LEN];
    raw.read_exact(&mut hs).unwrap();
    let whole = tagged_payload(7, 0);
    let half = tagged_payload(7, 1);
    raw.write_all(&whole).unwrap();
    raw.write_all(&half[..10]).unwrap();
    let mut ack = [0u8; 1];
    raw.read_exact(&mut ack).unwrap();
    assert_eq!(ack, [1]);
    drop(raw); // disconnect mid-sample
    let mut client = connect(addr, 8);
    send_tagged(&mut client, 8, 0).unwrap();
    client.wait(Some(Instant::now() + PATIENCE)).unwrap();
    let mut got = collect_tagged(&mut consumer, 1);
    got.sort_unstable();
    assert_eq!(got, vec![(7, 0), (8, 0)]);
}

#[test]
fn a_slow_consumer_blocks_producers_and_nothing_is_dropped() {
    const PER_CLIENT: u64 = 500;
    let (mut consumer, server, addr) = start(4, 2, 2, 16);
    let senders = spawn_senders(addr, 4, PER_CLIENT, 4);
    // Let the ring and every queue fill up before consuming anything.
    wait_until("producers hitting backpressure", || server.snapshot().push_blocked_count > 0);
    let got = collect_tagged(&mut consumer, 4 * PER_CLIENT as usize / 4);
    assert_exactly_once_in_order(&got, 4, PER_CLIENT);
    for s in senders {
        s.join().unwrap();
    }
}

#[test]
fn samples_acked_before_a_client_vanishes_are_delivered() {
    let (mut consumer, _server, addr) = start(10, 3, 64, 16);
    for producer in 0..3u32 {
        let mut client = connect(addr, 64);
        for seq in 0..10 {
            send_tagged(&mut client, producer, seq).unwrap();
        }
        client.wait(Some(Instant::now() + PATIENCE)).unwrap();
        drop(client); // gone right after the acks, before the drainer necessarily ran
    }
    let got = collect_tagged(&mut consumer, 3);
    assert_exactly_once_in_order(&got, 3, 10);
}

#[test]
fn connections_beyond_the_limit_are_refused_cleanly() {
    let (mut consumer, _server, addr) = start(1, 4, 8, 2);
    let mut a = connect(addr, 8);
    let mut b = connect(addr, 8);
    // Both complete a sample: working connections are never evicted for a newcomer (idle ones
    // would be, to admit it).
    send_tagged(&mut a, 0, 0).unwrap();
    send_tagged(&mut b, 1, 0).unwrap();
    a.wait(Some(Instant::now() + PATIENCE)).unwrap();
    b.wait(Some(Instant::now() + PATIENCE)).unwrap();
    match TcpSender::connect(client_config(addr.port(), 8, Protocol::Auto), PATIENCE) {
        Err(EchoError::Disconnected(msg)) => assert!(msg.contains("handshake"), "{msg}"),
        Err(other) => panic!("expected a clean refusal, got {other:?}"),
        Ok(_) => panic!("a third connection was accepted with max_connections = 2"),
    }
    // The accepted ones still work.
    send_tagged(&mut a, 0, 1).unwrap();
    let mut got = collect_tagged(&mut consumer, 3);
    got.sort_unstable();
    assert_eq!(got, vec![(0, 0), (0, 1), (1, 0)]);
}

#[test]
fn shutdown_with_live_connections_unblocks_everyone() {
    let (mut consumer, mut server, addr) = start(4, 2, 2, 16);
    let (tx, rx) = mpsc::channel();
    let senders: Vec<_> = (0..4u32)
        .map(|producer| {
            let tx = tx.clone();
            thread::spawn(move || {
                let mut client = connect(addr, 4);
                tx.send(()).unwrap();
                // Sends until the server goes away: the ring fills, then this blocks.
                let mut seq = 0;
                let err = loop {
                    if let Err(e) = send_tagged(&mut client, producer, seq) {
                        break e;
                    }
                    seq += 1;
                    assert!(seq < 1_000_000, "never blocked");
                };
                assert!(matches!(err, EchoError::Disconnected(_)), "{err:?}");
            })
        })
        .collect();
    for _ in 0..4 {
        rx.recv_timeout(PATIENCE).unwrap();
    }
    wait_until("producers blocking", || server.snapshot().push_blocked_count > 0);
    let started = Instant::now();
    server.shutdown();
    assert!(started.elapsed() < Duration::from_secs(5), "shutdown took {:?}", started.elapsed());
    for s in senders {
        s.join().unwrap();
    }
    assert!(matches!(consumer.sample(None), Err(EchoError::Closed)));
}

#[test]
fn a_port_in_use_is_an_error_naming_it() {
    let (_consumer, _server, addr) = start(1, 2, 8, 4);
    let store = Store::new(tagged_spec(), 1, 2).unwrap();
    let tcp = TcpConfig {
        num_threads: 1,
        max_connections: 4,
        ..TcpConfig::new("127.0.0.1", addr.port())
    };
    let err = TcpIngress::start(Backend::Fifo(store.clone()), IngressConfig::new(1, 2), &tcp)
        .err()
        .expect("bind must fail");
    assert!(err.to_string().contains(&format!("127.0.0.1:{}", addr.port())), "{err}");
}

#[test]
fn a_stalled_large_write_resumes_where_it_stopped() {
    use echo::{ArraySpec, DataSpec};
    const BYTES: usize = 16 << 20; // more than the loopback socket buffers hold
    let spec = DataSpec::new(vec![ArraySpec::new(vec![BYTES], 1).unwrap()]).unwrap();
    let store = Store::new(spec, 1, 2).unwrap();
    let mut consumer = store.consumer().unwrap();
    let tcp = TcpConfig { num_threads: 1, max_connections: 4, ..TcpConfig::new("127.0.0.1", 0) };
    let server =
        TcpIngress::start(Backend::Fifo(store.clone()), IngressConfig::new(1, 1), &tcp).unwrap();
    let port = server.local_addr().port();
    let (stalled_tx, stalled_rx) = mpsc::channel();
    let sender = thread::spawn(move || {
        let layout =
            Layout::untyped(&DataSpec::new(vec![ArraySpec::new(vec![BYTES], 1).unwrap()]).unwrap());
        let mut client =
            TcpSender::connect(ClientConfig::new("127.0.0.1", port, layout), PATIENCE).unwrap();
        let mut stalls = 0;
        for i in 0..12u8 {
            let payload = vec![i; BYTES];
            // Tiny deadlines: the writes stall mid-sample and must resume, not restart.
            loop {
                match client.send(
                    &[&payload],
                    FrameMeta::default(),
                    Some(Instant::now() + Duration::from_millis(5)),
                ) {
                    Ok(()) => break,
                    Err(EchoError::Stalled) => {
                        stalls += 1;
                        let _ = stalled_tx.send(());
                    }
                    Err(EchoError::TimedOut) => assert_eq!(client.in_progress(), 0),
                    Err(e) => panic!("{e:?}"),
                }
            }
        }
        assert!(client.close(Some(Instant::now() + PATIENCE)));
        stalls
    });
    // Consume nothing until a write has stalled mid-sample: with the ring, queue and pool full
    // the server stops reading, and 16 MiB samples do not fit in the socket buffers.
    stalled_rx.recv_timeout(PATIENCE).expect("no write ever stalled mid-sample");
    for i in 0..12u8 {
        consumer.sample(Some(Instant::now() + PATIENCE)).unwrap();
        consumer.read_leaf(0, |b| assert!(b.iter().all(|&x| x == i), "sample {i} is torn"));
    }
    let stalls = sender.join().unwrap();
    assert!(stalls > 0, "the test never exercised a stalled write");
}
