//! The parameter channel's server side, from a raw v2 socket: a client that asks (hello bit 5)
//! hears the latest version at once and each new one, fetches a version chunk by chunk, bit
//! for bit, and is told to start over when two publishes overtook its fetch; a fetch past the
//! parameters or longer than a chunk ends the connection with the reason; a client that did
//! not ask is served no fetch; a publish of another layout or a version that does not grow
//! is refused and changes nothing. Then from the client (`TcpSender::fetch_params`): whole
//! versions bit for bit while the learner publishes, never one going back; a version not yet
//! published waited for until the deadline; a layout of another size refused.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::{tagged_hello, tagged_spec, PATIENCE};
use echo::backend::BackendConfig;
use echo::server::{Server, ServerConfig};
use echo::spec::{ArraySpec, DataSpec};
use echo::transport::client::TcpSender;
use echo::transport::tcp::TcpConfig;
use echo::transport::wire::params::{self, Chunk, Fetch, CHUNK_HEADER_LEN, MAX_CHUNK};
use echo::transport::wire::v2::{self, Accept};
use echo::transport::wire::ACK;

/// The parameters: 3,000 f32 and 100 u8 (12,100 bytes).
fn param_spec() -> DataSpec {
    DataSpec::new(vec![
        ArraySpec::new(vec![3000], 4).unwrap(),
        ArraySpec::new(vec![100], 1).unwrap(),
    ])
    .unwrap()
}

/// Version `v`'s bytes: a pattern of the version and the position.
fn version_bytes(v: u64) -> (Vec<u8>, Vec<u8>) {
    let byte = |i: usize| (i as u64).wrapping_mul(31).wrapping_add(v * 7) as u8;
    ((0..12_000).map(byte).collect(), (12_000..12_100).map(byte).collect())
}

fn publish(server: &Server, version: Option<u64>, pattern: u64) -> Result<u64, echo::EchoError> {
    let (a, b) = version_bytes(pattern);
    server.publish(&param_spec(), &[&a, &b], version, None)
}

fn whole(v: u64) -> Vec<u8> {
    let (mut a, b) = version_bytes(v);
    a.extend_from_slice(&b);
    a
}

fn server() -> (Server, SocketAddr) {
    let config = ServerConfig {
        backend: BackendConfig::Fifo { batch_size: 4, num_batches: 4 },
        num_drainers: 1,
        producer_queue_size: Some(8),
        wire_codecs: Vec::new(),
        name: None,
        versions: None,
    };
    let server = Server::new(tagged_spec(), config).unwrap();
    let tcp = TcpConfig { num_threads: 2, ..TcpConfig::new("127.0.0.1", 0) };
    let port = server.start(tcp, 1 << 22).unwrap();
    (server, SocketAddr::from(([127, 0, 0, 1], port)))
}

/// A raw v2 client of session `[session; 16]` that asks for parameters when `params`.
fn client(addr: SocketAddr, session: u8, params: bool) -> (TcpStream, Accept) {
    let hello = v2::Hello { params, ..tagged_hello(session, false, true, false) };
    common::raw_client_of(addr, &tagged_spec(), hello)
}

/// What the server sends a client that fetches: version notices and chunks.
#[derive(Debug, PartialEq)]
enum Message {
    Version(u64),
    Chunk(Chunk, Vec<u8>),
}

fn next_message(raw: &mut TcpStream, asked: &Fetch) -> Message {
    let mut kind = [0u8; 1];
    raw.read_exact(&mut kind).unwrap();
    match kind[0] {
        params::VERSION => {
            let mut rest = [0u8; 8];
            raw.read_exact(&mut rest).unwrap();
            Message::Version(u64::from_le_bytes(rest))
        }
        params::CHUNK => {
            let mut header = [0u8; CHUNK_HEADER_LEN];
            header[0] = params::CHUNK;
            raw.read_exact(&mut header[1..]).unwrap();
            let chunk = Chunk::parse(&header, asked, 12_100).unwrap().unwrap();
            let mut bytes = vec![0u8; chunk.len as usize];
            raw.read_exact(&mut bytes).unwrap();
            Message::Chunk(chunk, bytes)
        }
        other => panic!("unexpected byte {other:#04x}"),
    }
}

/// Sends `fetch` and returns its chunk, collecting the version notices on the way.
fn fetch(raw: &mut TcpStream, fetch: Fetch, versions: &mut Vec<u64>) -> (Chunk, Vec<u8>) {
    raw.write_all(&fetch.encode()).unwrap();
    loop {
        match next_message(raw, &fetch) {
            Message::Version(v) => versions.push(v),
            Message::Chunk(chunk, bytes) => return (chunk, bytes),
        }
    }
}

#[test]
fn a_client_fetches_a_version_bit_for_bit_and_hears_of_every_new_one() {
    let (server, addr) = server();
    let (mut raw, accept) = client(addr, 1, true);
    assert!(accept.params, "a client that asks is served");
    let mut versions = Vec::new();
    // Nothing published yet: version 0, no bytes.
    let (none, bytes) = fetch(&mut raw, Fetch { version: 0, offset: 0, len: 4096 }, &mut versions);
    assert_eq!((none.version, none.size, bytes.len()), (0, 0, 0));
    assert_eq!(publish(&server, None, 1).unwrap(), 1);
    // The whole version in chunks of 4 KiB: the first asks for the latest, the rest for it.
    let mut got = Vec::new();
    let mut version = 0;
    while got.len() < 12_100 {
        let len = (12_100 - got.len()).min(4096) as u32;
        let asked = Fetch { version, offset: got.len() as u64, len };
        let (chunk, bytes) = fetch(&mut raw, asked, &mut versions);
        assert!(!chunk.superseded(&asked));
        version = chunk.version;
        got.extend_from_slice(&bytes);
    }
    assert_eq!((version, &got), (1, &whole(1)));
    // Two publishes overtake a fetch of version 1: it is gone, 3 is the latest.
    assert_eq!(publish(&server, None, 2).unwrap(), 2);
    assert_eq!(publish(&server, Some(3), 3).unwrap(), 3);
    let asked = Fetch { version: 1, offset: 4096, len: 4096 };
    let (gone, bytes) = fetch(&mut raw, asked, &mut versions);
    assert!(gone.superseded(&asked));
    assert_eq!((gone.version, bytes.len()), (3, 0));
    // Version 2 is still held (the one before the latest).
    let (held, bytes) = fetch(&mut raw, Fetch { version: 2, offset: 0, len: 8 }, &mut versions);
    assert_eq!((held.version, &bytes[..]), (2, &whole(2)[..8]));
    // Every version was announced, in order, none twice (a notice may cover two publishes).
    let (_, _) = fetch(&mut raw, Fetch { version: 3, offset: 12_092, len: 8 }, &mut versions);
    assert_eq!(versions.first(), Some(&1));
    assert_eq!(versions.last(), Some(&3));
    assert!(versions.windows(2).all(|w| w[0] < w[1]), "{versions:?}");
    // Samples still flow on the same connection: one sample frame, one ack.
    let mut frame = vec![v2::SAMPLE];
    frame.extend_from_slice(&common::tagged_payload(1, 0));
    raw.write_all(&frame).unwrap();
    let mut ack = [0u8; 1];
    raw.read_exact(&mut ack).unwrap();
    assert_eq!(ack[0], ACK);
}

#[test]
fn a_fetch_past_the_parameters_or_longer_than_a_chunk_ends_the_connection() {
    let (server, addr) = server();
    publish(&server, None, 1).unwrap();
    for (bad, why) in [
        (
            Fetch { version: 1, offset: 12_000, len: 101 },
            "bytes 12000..+101 of parameters of 12100",
        ),
        (Fetch { version: 1, offset: 0, len: MAX_CHUNK + 1 }, "more than a chunk's"),
    ] {
        let (mut raw, _) = client(addr, 2, true);
        raw.write_all(&bad.encode()).unwrap();
        let mut received = Vec::new();
        let _ = raw.read_to_end(&mut received);
        let at = received.iter().position(|&b| b == v2::ERROR).expect("an error frame");
        let (message, _) = v2::parse_error(&received[at + 1..]).unwrap().unwrap();
        assert!(message.contains(why), "{message}");
    }
}

#[test]
fn a_client_that_did_not_ask_is_served_no_fetch() {
    let (server, addr) = server();
    publish(&server, None, 1).unwrap();
    let (mut raw, accept) = client(addr, 3, false);
    assert!(!accept.params);
    raw.write_all(&Fetch { version: 0, offset: 0, len: 8 }.encode()).unwrap();
    let mut received = Vec::new();
    let _ = raw.read_to_end(&mut received);
    let at = received.iter().position(|&b| b == v2::ERROR).expect("an error frame");
    let (message, _) = v2::parse_error(&received[at + 1..]).unwrap().unwrap();
    assert!(message.contains("unknown frame type 0x32"), "{message}");
}

#[test]
fn a_publish_of_another_layout_or_an_old_version_changes_nothing() {
    let (server, _) = server();
    assert_eq!(server.params().latest(), 0);
    publish(&server, Some(5), 5).unwrap();
    let other = DataSpec::new(vec![ArraySpec::new(vec![3000], 4).unwrap()]).unwrap();
    let (a, _) = version_bytes(6);
    let err = server.publish(&other, &[&a], None, None).unwrap_err().to_string();
    assert!(err.contains("fixed by the first publish: 2 leaves of 12100 bytes"), "{err}");
    let err = publish(&server, Some(5), 6).unwrap_err().to_string();
    assert!(err.contains("above the latest (5), got 5"), "{err}");
    assert_eq!(server.params().latest(), 5);
    let (version, bytes) = server.params().store().unwrap().snapshot().unwrap();
    assert_eq!((version, bytes), (5, whole(5)));
}

/// 3 MB of parameters (three chunks): 750,000 u32, every one its version times a prime plus
/// its index, so any byte of another version shows.
fn big_spec() -> DataSpec {
    DataSpec::new(vec![ArraySpec::new(vec![750_000], 4).unwrap()]).unwrap()
}

fn big(v: u64) -> Vec<u8> {
    (0..750_000u32)
        .flat_map(|i| (i ^ (v as u32).wrapping_mul(2_654_435_761)).to_le_bytes())
        .collect()
}

fn sender(addr: SocketAddr) -> TcpSender {
    TcpSender::connect(common::tagged_client(addr.port()), PATIENCE).unwrap()
}

#[test]
fn a_client_fetches_whole_versions_while_the_learner_publishes_and_never_sees_a_torn_one() {
    let (server, addr) = server();
    let server = std::sync::Arc::new(server);
    let mut client = sender(addr);
    assert_eq!(client.params_version(), 0);
    server.publish(&big_spec(), &[&big(1)], None, None).unwrap();
    let publisher = {
        let server = std::sync::Arc::clone(&server);
        std::thread::spawn(move || {
            for v in 2..=25u64 {
                server.publish(&big_spec(), &[&big(v)], None, None).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        })
    };
    let mut out = vec![0u8; 3_000_000];
    let mut last = 0;
    for _ in 0..200 {
        let version =
            client.fetch_params(&mut out, 0, Some(Instant::now() + PATIENCE), false).unwrap();
        assert!(version >= last, "went back from {last} to {version}");
        assert!(out == big(version), "version {version} is not bit for bit");
        last = version;
        if version == 25 {
            break;
        }
    }
    publisher.join().unwrap();
    let version =
        client.fetch_params(&mut out, 25, Some(Instant::now() + PATIENCE), false).unwrap();
    assert_eq!(version, 25);
    assert!(out == big(25));
    common::wait_until("the client heard of version 25", || client.params_version() == 25);
}

#[test]
fn a_fetch_of_a_version_not_yet_published_waits_for_it_until_its_deadline() {
    let (server, addr) = server();
    let mut client = sender(addr);
    let mut out = vec![0u8; 3_000_000];
    let started = Instant::now();
    let early = client.fetch_params(&mut out, 0, Some(started + Duration::from_millis(200)), false);
    assert!(matches!(early, Err(echo::EchoError::TimedOut)), "{early:?}");
    assert!(started.elapsed() >= Duration::from_millis(200));
    server.publish(&big_spec(), &[&big(1)], None, None).unwrap();
    assert_eq!(
        client.fetch_params(&mut out, 1, Some(Instant::now() + PATIENCE), false).unwrap(),
        1
    );
    let later =
        client.fetch_params(&mut out, 2, Some(Instant::now() + Duration::from_millis(100)), false);
    assert!(matches!(later, Err(echo::EchoError::TimedOut)), "{later:?}");
    server.publish(&big_spec(), &[&big(7)], Some(7), None).unwrap();
    assert_eq!(
        client.fetch_params(&mut out, 2, Some(Instant::now() + PATIENCE), false).unwrap(),
        7
    );
    assert!(out == big(7));
    // Samples go on as before on the same connection.
    common::send_tagged(&mut client, 1, 0).unwrap();
    client.wait(Some(Instant::now() + PATIENCE)).unwrap();
}

#[test]
fn a_fetch_of_the_wrong_size_is_refused_with_the_reason() {
    let (server, addr) = server();
    server.publish(&big_spec(), &[&big(1)], None, None).unwrap();
    let mut client = sender(addr);
    let mut out = vec![0u8; 100];
    let err = client.fetch_params(&mut out, 1, Some(Instant::now() + PATIENCE), false).unwrap_err();
    let text = err.to_string();
    let why = "publishes parameters of 3000000 bytes, this client's layout has 100";
    assert!(text.contains(why), "{text}");
    // A mistake of this client's layout, not the connection's: it goes on.
    let mut right = vec![0u8; 3_000_000];
    let deadline = Some(Instant::now() + PATIENCE);
    assert_eq!(client.fetch_params(&mut right, 1, deadline, false).unwrap(), 1);
}

#[test]
fn a_fetch_cut_into_short_slices_goes_on_where_it_stopped() {
    let (server, addr) = server();
    server.publish(&big_spec(), &[&big(3)], Some(3), None).unwrap();
    let mut client = sender(addr);
    let mut out = vec![0u8; 3_000_000];
    let (mut resume, mut slices) = (false, 0);
    let version = loop {
        slices += 1;
        assert!(slices < 100_000, "no progress");
        // Far shorter than a chunk takes: each call waits on the request the last one left.
        let slice = Some(Instant::now() + Duration::from_micros(100));
        match client.fetch_params(&mut out, 1, slice, resume) {
            Ok(version) => break version,
            Err(echo::EchoError::TimedOut) => resume = true,
            Err(other) => panic!("{other}"),
        }
    };
    assert_eq!(version, 3);
    assert!(out == big(3), "resumed slices make up the whole version");
    assert!(slices > 1, "the fetch was cut at least once ({slices} slices)");
    eprintln!("3 MB in {slices} slices of 100 us");
}

/// Version `v` of parameters that compress: 3,000,000 bytes (two whole chunks and a short
/// one) of runs of the version's byte, with the position sprinkled in every 256 bytes.
fn compressible(v: u64) -> Vec<u8> {
    (0..750_000u32).flat_map(|i| if i % 64 == 0 { i.to_le_bytes() } else { [v as u8; 4] }).collect()
}

#[test]
fn a_version_published_compressed_comes_compressed_and_decompresses_bit_for_bit() {
    use echo::codec::Codec;
    let (server, addr) = server();
    let mut client = sender(addr);
    let mut out = vec![0u8; 3_000_000];
    for (v, codec) in [(1, Codec::Lz4), (2, Codec::Zstd { level: 3 }), (3, Codec::Lz4)] {
        let before = server.params().counts().bytes_served;
        server.publish(&big_spec(), &[&compressible(v)], None, Some(codec)).unwrap();
        let deadline = Some(Instant::now() + PATIENCE);
        assert_eq!(client.fetch_params(&mut out, v, deadline, false).unwrap(), v);
        assert!(out == compressible(v), "version {v} ({codec:?}) is not bit for bit");
        let served = server.params().counts().bytes_served - before;
        assert!(served < 300_000, "{served} bytes on the wire for 3 MB that compress");
    }
    // Published raw again: served raw.
    let before = server.params().counts().bytes_served;
    server.publish(&big_spec(), &[&compressible(4)], None, None).unwrap();
    let deadline = Some(Instant::now() + PATIENCE);
    assert_eq!(client.fetch_params(&mut out, 4, deadline, false).unwrap(), 4);
    assert!(out == compressible(4));
    assert_eq!(server.params().counts().bytes_served - before, 3_000_000);
}

#[test]
fn only_a_whole_compressed_chunk_is_served_compressed_and_one_that_does_not_shrink_is_raw() {
    use echo::codec::Codec;
    let (server, addr) = server();
    // The first chunk compresses, the rest (noise) does not.
    let mut bytes = compressible(1);
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for byte in &mut bytes[MAX_CHUNK as usize..] {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        *byte = state as u8;
    }
    server.publish(&big_spec(), &[&bytes], None, Some(Codec::Lz4)).unwrap();
    let (mut raw, _) = client(addr, 2, true);
    let ask = |raw: &mut TcpStream, offset: u64, len: u32| {
        let asked = Fetch { version: 1, offset, len };
        raw.write_all(&asked.encode()).unwrap();
        loop {
            let mut kind = [0u8; 1];
            raw.read_exact(&mut kind).unwrap();
            let header_len = match kind[0] {
                params::VERSION => {
                    raw.read_exact(&mut [0u8; 8]).unwrap();
                    continue;
                }
                params::CHUNK => CHUNK_HEADER_LEN,
                params::PACKED => params::PACKED_HEADER_LEN,
                other => panic!("unexpected byte {other:#04x}"),
            };
            let mut header = vec![kind[0]; header_len];
            raw.read_exact(&mut header[1..]).unwrap();
            let chunk = Chunk::parse(&header, &asked, 3_000_000).unwrap().unwrap();
            let mut wire = vec![0u8; chunk.wire_len()];
            raw.read_exact(&mut wire).unwrap();
            return (chunk, wire);
        }
    };
    let (first, wire) = ask(&mut raw, 0, MAX_CHUNK);
    let (codec, packed) = first.packed.expect("the whole first chunk comes compressed");
    assert_eq!((codec, packed as usize), (Codec::Lz4, wire.len()));
    let mut got = vec![0u8; MAX_CHUNK as usize];
    codec.decompress_into(&wire, &mut got).unwrap();
    assert!(got[..] == bytes[..MAX_CHUNK as usize]);
    // Part of a chunk, and a chunk of noise: raw.
    let (part, wire) = ask(&mut raw, 16, 4096);
    assert_eq!((part.packed, &wire[..]), (None, &bytes[16..16 + 4096]));
    let (noise, wire) = ask(&mut raw, u64::from(MAX_CHUNK), MAX_CHUNK);
    assert_eq!(noise.packed, None);
    assert!(wire[..] == bytes[MAX_CHUNK as usize..2 * MAX_CHUNK as usize]);
}

#[test]
fn fetching_workers_take_no_byte_budget_from_the_samples() {
    use echo::transport::wire::v2::FrameMeta;
    // A byte budget of 2 MiB, two chunks' worth: 8 workers fetching 3 MB versions at once,
    // while another sends 400 samples through the same budget. Every sample is acked (the
    // chunks being served are lent their own buffers) and every copy is bit for bit.
    let config = ServerConfig {
        backend: BackendConfig::Fifo { batch_size: 4, num_batches: 128 },
        num_drainers: 1,
        producer_queue_size: Some(8),
        wire_codecs: Vec::new(),
        name: None,
        versions: None,
    };
    let server = Server::new(common::tagged_spec(), config).unwrap();
    let tcp = TcpConfig { num_threads: 2, ..TcpConfig::new("127.0.0.1", 0) };
    let port = server.start(tcp, 1 << 21).unwrap();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    server.publish(&big_spec(), &[&big(1)], None, None).unwrap();
    let fetchers: Vec<_> = (0..8)
        .map(|_| {
            std::thread::spawn(move || {
                let mut client = sender(addr);
                let mut out = vec![0u8; 3_000_000];
                for _ in 0..4 {
                    let deadline = Some(Instant::now() + PATIENCE);
                    let version = client.fetch_params(&mut out, 1, deadline, false).unwrap();
                    assert!(out == big(version), "version {version} is not bit for bit");
                }
            })
        })
        .collect();
    let mut samples = sender(addr);
    for seq in 0..400 {
        let p = common::tagged_payload(9, seq);
        let deadline = Some(Instant::now() + PATIENCE);
        samples.send(&[&p[..4], &p[4..12], &p[12..]], FrameMeta::default(), deadline).unwrap();
    }
    samples.wait(Some(Instant::now() + PATIENCE)).unwrap();
    for fetcher in fetchers {
        fetcher.join().unwrap();
    }
    assert!(server.params().counts().chunks_served >= 8 * 4 * 3);
}
