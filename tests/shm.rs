//! The same-host shared-memory channel (Linux): the ring protocol under real contention (a
//! producer and a consumer thread on a two-slot ring, each sleeping on its eventfd when it
//! must), the reader's defences against a hostile writer, the attach handshake's nonce check,
//! and whole clients sending through it to a real server.
#![cfg(target_os = "linux")]

mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::{
    batch_leaves, decode, send_tagged, start_tagged_fifo, tagged_client, tagged_payload,
    tagged_spec, PATIENCE,
};
use echo::backend::Backend;
use echo::ingress::IngressConfig;
use echo::transport::client::{SharedMemory, TcpSender};
use echo::transport::shm::{self, Reader, Writer, HEADER_LEN, OFF_TAIL, SLOT_HEADER};
use echo::transport::tcp::TcpConfig;
use echo::transport::wire::v2::{self, FrameMeta, Offer, Reply};
use echo::transport::TcpIngress;
use echo::{Consumer, EchoError, Store};

/// Samples moved through the two-slot ring.
const COUNT: u64 = 20_000;
/// Bytes per sample: the sequence number, repeated.
const PAYLOAD: usize = 64;
/// Far longer than any step takes; a lost wake-up makes a wait last this long and the
/// watchdog below fail the test.
const LONG_WAIT: Duration = Duration::from_secs(60);

/// Attaches a writer to `reader` through the real handshake: a Unix socket at a random
/// abstract name, the nonce, and SCM_RIGHTS (a thread plays the learner's side).
fn attach(reader: &Reader, payload: usize) -> Writer {
    let name = shm::random_name().unwrap();
    let listener = shm::listen(&name).unwrap();
    listener.set_nonblocking(false).unwrap();
    let nonce = [7u8; shm::NONCE_LEN];
    let fds = reader.fds();
    let server = thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        assert_eq!(shm::peer_uid(std::os::fd::AsFd::as_fd(&stream)).unwrap(), shm::own_uid());
        let mut got = [0u8; shm::NONCE_LEN];
        stream.read_exact(&mut got).unwrap();
        assert_eq!(got, [7u8; shm::NONCE_LEN]);
        shm::send_fds(stream.as_raw_fd(), shm::ATTACH_MESSAGE, &fds).unwrap();
    });
    let writer = Writer::attach(&name, &nonce, payload, PATIENCE).unwrap();
    server.join().unwrap();
    writer
}

fn payload_of(seq: u64) -> [u8; PAYLOAD] {
    let mut out = [0u8; PAYLOAD];
    for chunk in out.chunks_mut(8) {
        chunk.copy_from_slice(&seq.to_le_bytes());
    }
    out
}

#[test]
fn a_two_slot_ring_moves_every_sample_once_in_order_with_both_sides_sleeping() {
    let mut reader = Reader::with_slots(PAYLOAD, 2).unwrap();
    let mut writer = attach(&reader, PAYLOAD);
    assert_eq!(writer.slots(), 2);
    let (done_tx, done_rx) = mpsc::channel();
    let consumer = thread::spawn(move || {
        let mut buf = [0u8; PAYLOAD];
        let mut sleeps = 0u64;
        for expected in 0..COUNT {
            // Bounded: each round either takes a sample or sleeps on the bell, which a
            // commit always rings (a lost ring would block for LONG_WAIT).
            for _ in 0..1_000_000 {
                if reader.available().unwrap() > 0 {
                    break;
                }
                reader.sleep_begin();
                if reader.available().unwrap() == 0 {
                    reader.data.wait(LONG_WAIT);
                    sleeps += 1;
                }
                reader.sleep_end();
            }
            let meta = reader.copy_next(&mut buf).unwrap();
            assert_eq!(meta.priority, (expected % 3 == 0).then_some(expected as f64));
            assert_eq!(buf, payload_of(expected), "sample {expected}");
            reader.advance();
        }
        done_tx.send(sleeps).unwrap();
        reader
    });
    let mut waits = 0u64;
    for seq in 0..COUNT {
        let p = payload_of(seq);
        let priority = (seq % 3 == 0).then_some(seq as f64);
        for _ in 0..1_000_000 {
            if writer.try_send(&[&p[..8], &p[8..]], &FrameMeta { priority, ..FrameMeta::default() })
            {
                break;
            }
            assert!(
                writer.wait_taken(seq.saturating_sub(1), Instant::now() + LONG_WAIT),
                "no room"
            );
            waits += 1;
        }
    }
    assert!(writer.wait_taken(COUNT, Instant::now() + LONG_WAIT));
    let sleeps = done_rx.recv_timeout(LONG_WAIT).expect("the consumer hung");
    let reader = consumer.join().unwrap();
    assert_eq!((reader.head(), writer.committed(), writer.taken()), (COUNT, COUNT, COUNT));
    // The run did exercise both sleeps (two slots: the sides keep catching up on each other).
    assert!(waits > 0 || sleeps > 0, "neither side ever waited");
}

#[test]
fn the_reader_never_trusts_what_a_hostile_writer_puts_in_the_segment() {
    let mut reader = Reader::with_slots(PAYLOAD, 4).unwrap();
    let mut writer = attach(&reader, PAYLOAD);
    let mut buf = [0u8; PAYLOAD];
    // A tail more than `slots` ahead, or behind the head: the channel is corrupt.
    for bad in [5u64, u64::MAX] {
        reader.scribble(OFF_TAIL, &bad.to_le_bytes());
        let err = reader.available().unwrap_err();
        assert_eq!((err.tail, err.head), (bad, 0));
    }
    reader.scribble(OFF_TAIL, &0u64.to_le_bytes());
    assert_eq!(reader.available().unwrap(), 0);
    // A committed slot whose header names another sample, or unknown flags: refused, and the
    // reader stays where it was.
    let p = payload_of(0);
    assert!(writer.try_send(&[&p], &FrameMeta::default()));
    reader.scribble(HEADER_LEN, &9u64.to_le_bytes());
    let err = reader.copy_next(&mut buf).unwrap_err();
    assert!(err.contains("holds sample 9"), "{err}");
    reader.scribble(HEADER_LEN, &0u64.to_le_bytes());
    reader.scribble(HEADER_LEN + 8, &0x80u32.to_le_bytes());
    assert!(reader.copy_next(&mut buf).unwrap_err().contains("flags"));
    reader.scribble(HEADER_LEN + 8, &0u32.to_le_bytes());
    // A payload torn by its writer after the commit only changes that sample's bytes.
    reader.scribble(HEADER_LEN + SLOT_HEADER, &[0xff; 5]);
    reader.copy_next(&mut buf).unwrap();
    assert_eq!(&buf[..5], &[0xff; 5]);
    assert_eq!(&buf[5..], &p[5..]);
    reader.advance();
    assert_eq!(reader.head(), 1);
    // Scribbles anywhere (past the end too: clamped) never panic the reader.
    for offset in [0, 8, 16, 64, 128, 192, 256, 4095, 4096, 1 << 40] {
        reader.scribble(offset, &[0xa5; 64]);
        let _ = reader.available();
    }
}

#[test]
fn attach_refuses_a_wrong_nonce_and_hands_over_with_the_right_one() {
    let store = Store::new(tagged_spec(), 2, 4).unwrap();
    let tcp = TcpConfig::new("127.0.0.1", 0);
    let server =
        TcpIngress::start(Backend::Fifo(store.clone()), IngressConfig::new(1, 8), &tcp).unwrap();
    let mut raw = std::net::TcpStream::connect(server.local_addr()).unwrap();
    raw.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut greeting = Vec::new();
    let offer = loop {
        let mut chunk = [0u8; 256];
        let n = raw.read(&mut chunk).unwrap();
        assert!(n > 0, "server closed");
        greeting.extend_from_slice(&chunk[..n]);
        if greeting.len() >= v2::OFFER_LEN {
            if let Ok(Some(offer)) = Offer::parse(&greeting[greeting.len() - v2::OFFER_LEN..]) {
                break offer;
            }
        }
    };
    let hello = common::tagged_hello(1, true, false, false);
    raw.write_all(&hello.encode(&offer, None).unwrap()).unwrap();
    let mut received = Vec::new();
    let accept = loop {
        let mut chunk = [0u8; 256];
        let n = raw.read(&mut chunk).unwrap();
        assert!(n > 0, "server closed");
        received.extend_from_slice(&chunk[..n]);
        if let Some((Reply::Accepted(accept), _)) = Reply::parse(&received).unwrap() {
            break accept;
        }
    };
    let shm_offer = accept.shm.expect("a loopback client is offered shared memory");
    assert!(shm_offer.name.starts_with(shm::NAME_PREFIX.as_bytes()));
    let addr = UnixAddr::from_abstract_name(&shm_offer.name).unwrap();
    // A wrong nonce: the server hangs up without sending anything.
    let mut wrong = UnixStream::connect_addr(&addr).unwrap();
    wrong.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut bad = shm_offer.nonce;
    bad[0] ^= 1;
    wrong.write_all(&bad).unwrap();
    let mut message = [0u8; 8];
    let (n, fds) = shm::recv_fds(wrong.as_raw_fd(), &mut message).unwrap();
    assert_eq!((n, fds.len()), (0, 0));
    // The right one: the segment and both bells.
    let writer =
        Writer::attach(&shm_offer.name, &shm_offer.nonce, tagged_spec().payload_size(), PATIENCE)
            .unwrap();
    assert!(writer.slots() >= shm::MIN_SLOTS);
    drop(writer);
    drop(raw);
    drop(server);
}

fn start(batch_size: usize) -> (Consumer, TcpIngress, SocketAddr) {
    start_tagged_fifo(&TcpConfig::new("127.0.0.1", 0), batch_size, 4, 8)
}

#[test]
fn clients_on_shared_memory_and_tcp_deliver_exactly_once_in_order() {
    const PER_CLIENT: u64 = 2_000;
    let (mut consumer, server, addr) = start(10);
    let senders: Vec<_> = (0..4u32)
        .map(|producer| {
            thread::spawn(move || {
                let mut config = tagged_client(addr.port());
                config.shared_memory =
                    if producer < 3 { SharedMemory::Required } else { SharedMemory::Off };
                let mut client = TcpSender::connect(config, PATIENCE).unwrap();
                let path = client.transport_path();
                for seq in 0..PER_CLIENT {
                    send_tagged(&mut client, producer, seq).unwrap();
                }
                assert!(client.close(Some(Instant::now() + PATIENCE)), "close did not flush");
                let p = tagged_payload(producer, 0);
                assert!(matches!(
                    client.send(&[&p[..4], &p[4..12], &p[12..]], FrameMeta::default(), None),
                    Err(EchoError::Disconnected(_))
                ));
                path
            })
        })
        .collect();
    let mut next = [0u64; 4];
    for _ in 0..(4 * PER_CLIENT / 10) {
        consumer.sample(Some(Instant::now() + PATIENCE)).expect("batch did not arrive");
        let leaves = batch_leaves(&consumer);
        for i in 0..10 {
            let (producer, seq) = decode(&leaves, i);
            assert_eq!(seq, next[producer as usize], "producer {producer}");
            next[producer as usize] += 1;
        }
    }
    assert_eq!(next, [PER_CLIENT; 4]);
    let paths: Vec<_> = senders.into_iter().map(|s| s.join().unwrap()).collect();
    assert_eq!(paths, ["shm", "shm", "shm", "tcp"]);
    let snap = server.snapshot();
    assert_eq!(snap.shm_connections_total, 3);
    drop(server);
}

/// The environment variable that makes [`attach_as_another_user_when_asked`] act: the
/// offer's socket name and nonce, in hex, `name:nonce`.
const STRANGER: &str = "ECHO_TEST_SHM_STRANGER";
/// Attaches the child makes; more than the server's 8 refusals of its own uid's peers.
const STRANGER_ATTACHES: usize = 12;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// Does nothing unless [`STRANGER`] is set: then it is the child process of
/// `another_users_refused_attaches_do_not_cost_the_client_its_connection`, run as another
/// uid, and attaches [`STRANGER_ATTACHES`] times with the right nonce (a stranger that
/// learned it), each refused: the server hangs up without a descriptor.
#[test]
fn attach_as_another_user_when_asked() {
    let Ok(offer) = std::env::var(STRANGER) else { return };
    let (name, nonce) = offer.split_once(':').unwrap();
    let addr = UnixAddr::from_abstract_name(unhex(name)).unwrap();
    for _ in 0..STRANGER_ATTACHES {
        // Once the offer is withdrawn, nobody listens: stop there (the parent sees why).
        let Ok(mut stream) = UnixStream::connect_addr(&addr) else { return };
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        let _ = stream.write_all(&unhex(nonce));
        let mut message = [0u8; 8];
        let (n, fds) = shm::recv_fds(stream.as_raw_fd(), &mut message).unwrap_or((0, vec![]));
        assert_eq!((n, fds.len()), (0, 0), "another user was handed the segment");
    }
}

#[test]
fn another_users_refused_attaches_do_not_cost_the_client_its_connection() {
    use std::os::unix::process::CommandExt;
    if shm::own_uid() != 0 {
        eprintln!("skipped: only root can run a process as another user here");
        return;
    }
    let store = Store::new(tagged_spec(), 2, 4).unwrap();
    let tcp = TcpConfig::new("127.0.0.1", 0);
    let server =
        TcpIngress::start(Backend::Fifo(store.clone()), IngressConfig::new(1, 8), &tcp).unwrap();
    let mut raw = std::net::TcpStream::connect(server.local_addr()).unwrap();
    raw.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut greeting = Vec::new();
    let offer = loop {
        let mut chunk = [0u8; 256];
        let n = raw.read(&mut chunk).unwrap();
        assert!(n > 0, "server closed");
        greeting.extend_from_slice(&chunk[..n]);
        if greeting.len() >= v2::OFFER_LEN {
            if let Ok(Some(offer)) = Offer::parse(&greeting[greeting.len() - v2::OFFER_LEN..]) {
                break offer;
            }
        }
    };
    raw.write_all(&common::tagged_hello(1, true, false, false).encode(&offer, None).unwrap())
        .unwrap();
    let mut received = Vec::new();
    let accept = loop {
        let mut chunk = [0u8; 256];
        let n = raw.read(&mut chunk).unwrap();
        assert!(n > 0, "server closed");
        received.extend_from_slice(&chunk[..n]);
        if let Some((Reply::Accepted(accept), _)) = Reply::parse(&received).unwrap() {
            break accept;
        }
    };
    let shm_offer = accept.shm.expect("a loopback client is offered shared memory");
    // Another local user (nobody) attaches more often than the server refuses its own.
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "attach_as_another_user_when_asked", "--test-threads=1"])
        .env(STRANGER, format!("{}:{}", hex(&shm_offer.name), hex(&shm_offer.nonce)))
        .uid(65_534)
        .gid(65_534)
        .status()
        .unwrap();
    assert!(status.success(), "the other user's process: {status}");
    // The rightful client still attaches, on the connection it has.
    let writer =
        Writer::attach(&shm_offer.name, &shm_offer.nonce, tagged_spec().payload_size(), PATIENCE)
            .expect("the offer was withdrawn because of another user's attaches");
    assert!(writer.slots() >= shm::MIN_SLOTS);
    drop(writer);
    drop(raw);
    drop(server);
}
