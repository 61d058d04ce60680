//! Compression on the wire (v2) over real loopback sockets: clients that compress the leaves
//! the server names, with and without reconnection, samples bit-exact at the learner; and
//! every kind of bad compressed frame a hostile peer can send (truncated, a length above
//! what the codecs can produce, a decompression bomb, garbage, a compressed frame nobody
//! agreed to) ends that connection with an error frame and nothing else.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Instant;

use common::{
    collect_tagged, send_tagged, start_tagged_fifo, tagged_client, tagged_payload, tagged_spec,
    PATIENCE,
};
use echo::backend::Backend;
use echo::codec::{Codec, LeafCodecs};
use echo::ingress::IngressConfig;
use echo::transport::client::{ClientConfig, TcpSender};
use echo::transport::tcp::TcpConfig;
use echo::transport::wire::v2::Layout;
use echo::transport::wire::v2::{self, FrameMeta};
use echo::transport::TcpIngress;
use echo::{ArraySpec, DataSpec, Leaves, Store};

/// The tagged layout with its 13-byte pattern leaf (leaf 2) compressed by `codec`.
fn compressing(codec: Codec) -> TcpConfig {
    TcpConfig { codecs: vec![None, None, Some(codec)], ..TcpConfig::new("127.0.0.1", 0) }
}

#[test]
fn clients_compress_the_leaves_the_server_names_and_samples_arrive_bit_exact() {
    for codec in [Codec::Zstd { level: 1 }, Codec::Zstd { level: -2 }, Codec::Lz4] {
        let (mut consumer, _server, addr) = start_tagged_fifo(&compressing(codec), 4, 4, 8);
        let mut plain = TcpSender::connect(tagged_client(addr.port()), PATIENCE).unwrap();
        let codecs = plain.wire_codecs().expect("the server named codecs");
        assert_eq!(codecs.as_slice(), &[None, None, Some(codec)]);
        let raw = ClientConfig { wire_compression: false, ..tagged_client(addr.port()) };
        let mut raw = TcpSender::connect(raw, PATIENCE).unwrap();
        assert!(raw.wire_codecs().is_none(), "wire_compression=false sends raw");
        let resuming =
            ClientConfig { reconnect_timeout: Some(PATIENCE), ..tagged_client(addr.port()) };
        let mut resuming = TcpSender::connect(resuming, PATIENCE).unwrap();
        assert!(resuming.wire_codecs().is_some());
        for seq in 0..4 {
            send_tagged(&mut plain, 1, seq).unwrap();
        }
        plain.wait(Some(Instant::now() + PATIENCE)).unwrap();
        for seq in 0..4 {
            send_tagged(&mut raw, 2, seq).unwrap();
        }
        raw.wait(Some(Instant::now() + PATIENCE)).unwrap();
        for seq in 0..4 {
            send_tagged(&mut resuming, 3, seq).unwrap();
        }
        resuming.wait(Some(Instant::now() + PATIENCE)).unwrap();
        let mut got = collect_tagged(&mut consumer, 3);
        got.sort_unstable();
        let expected: Vec<(u32, u64)> = (1..=3).flat_map(|p| (0..4).map(move |s| (p, s))).collect();
        assert_eq!(got, expected, "{codec:?}: every sample once, every byte checked");
    }
}

/// A raw connection that said hello (asking for codecs when `codecs`) and read the reply.
fn raw_client(addr: SocketAddr, session: u8, codecs: bool) -> (TcpStream, v2::Accept) {
    common::raw_client_of(addr, &tagged_spec(), common::tagged_hello(session, false, true, codecs))
}

/// Everything the server sends until it closes: the error frame's message, if one came.
fn error_message(raw: &mut TcpStream) -> String {
    let mut received = Vec::new();
    let _ = raw.read_to_end(&mut received);
    let at = received.iter().position(|&b| b == v2::ERROR).expect("an error frame");
    let (message, _) = v2::parse_error(&received[at + 1..]).unwrap().expect("a whole message");
    message
}

/// A compressed sample frame: header, `body_len` (as given), body.
fn packed_frame(body_len: u32, body: &[u8]) -> Vec<u8> {
    let mut frame = vec![v2::SAMPLE | v2::PACKED];
    frame.extend_from_slice(&body_len.to_le_bytes());
    frame.extend_from_slice(body);
    frame
}

/// The body a well-behaved client sends for sample `seq` of producer 7.
fn good_body(codecs: &LeafCodecs, seq: u64) -> Vec<u8> {
    let p = tagged_payload(7, seq);
    let mut body = Vec::new();
    codecs.pack_body(&Leaves(&[&p[..4], &p[4..12], &p[12..]]), 0, &mut body);
    body
}

#[test]
fn bad_compressed_frames_end_their_connection_with_an_error_and_nothing_else() {
    let codec = Codec::Zstd { level: 1 };
    let (mut consumer, server, addr) = start_tagged_fifo(&compressing(codec), 2, 4, 8);
    let codecs = LeafCodecs::new(&tagged_spec(), vec![None, None, Some(codec)]).unwrap();
    let good = good_body(&codecs, 0);
    // The 12 raw bytes, then the packed item: u32 length, then the zstd frame.
    let (raw_part, item) = good.split_at(12);
    let mut bomb = raw_part.to_vec();
    let mut big = Vec::new();
    Codec::Zstd { level: 1 }.compress_append(&[0u8; 1 << 16], &mut big);
    bomb.extend_from_slice(&(big.len() as u32).to_le_bytes());
    bomb.extend_from_slice(&big);
    let mut wrong_len = good.clone();
    wrong_len[12] ^= 1; // the packed item's length no longer adds up
    let mut garbage = raw_part.to_vec();
    garbage.extend_from_slice(&8u32.to_le_bytes());
    garbage.extend_from_slice(&[0xAB; 8]);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("oversized length", packed_frame(u32::MAX, &[]), "compress to at most"),
        ("bomb", packed_frame(bomb.len() as u32, &bomb), "declares 65536 bytes"),
        ("lengths that do not add up", packed_frame(good.len() as u32, &wrong_len), "claims"),
        ("garbage", packed_frame(garbage.len() as u32, &garbage), "not a zstd frame"),
        ("short body", packed_frame(8, &good[..8]), "ends inside raw leaf"),
        ("no item", packed_frame(12, raw_part), "no room for its header"),
    ];
    assert!(item.len() > 4);
    for (i, (what, frame, expected)) in cases.into_iter().enumerate() {
        let (mut raw, accept) = raw_client(addr, 10 + i as u8, true);
        assert_eq!(accept.codecs.as_deref(), Some(codecs.as_slice()), "{what}");
        raw.write_all(&frame).unwrap();
        let message = error_message(&mut raw);
        assert!(message.contains(expected), "{what}: {message}");
    }
    // A compressed frame on a connection that did not ask for codecs.
    let (mut raw, accept) = raw_client(addr, 30, false);
    assert!(accept.codecs.is_none());
    raw.write_all(&packed_frame(good.len() as u32, &good)).unwrap();
    assert!(error_message(&mut raw).contains("agreed on no codecs"));
    // A truncated one: the peer goes away mid-body; nothing is queued.
    let (mut raw, _) = raw_client(addr, 31, true);
    raw.write_all(&packed_frame(good.len() as u32, &good)[..good.len() / 2]).unwrap();
    drop(raw);
    // Nothing of all that went in; a good raw frame and a good compressed one still do.
    let (mut raw, _) = raw_client(addr, 32, true);
    let mut frame = vec![v2::SAMPLE];
    frame.extend_from_slice(&tagged_payload(7, 0));
    raw.write_all(&frame).unwrap();
    raw.write_all(&packed_frame(good_body(&codecs, 1).len() as u32, &good_body(&codecs, 1)))
        .unwrap();
    assert_eq!(collect_tagged(&mut consumer, 1), vec![(7, 0), (7, 1)]);
    assert_eq!(server.snapshot().samples_inserted_total, 2);
    let meta = FrameMeta::default();
    assert_eq!(meta.encode().0[0] | v2::PACKED, 0x14);
}

/// The learner's resident memory, from /proc/self/statm.
fn resident_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[test]
fn compressed_bodies_a_peer_never_finishes_count_in_max_buffered_bytes() {
    // One compressed leaf of 1 MiB; peers that each declare a body of the most those leaves
    // can compress to and send 5 bytes of it. The learner holds for each only what the body
    // grew to (one step), inside the byte budget, and gives it all back when they go.
    const LEAF: usize = 1 << 20;
    const PEERS: usize = 48;
    let spec = DataSpec::new(vec![ArraySpec::new(vec![LEAF], 1).unwrap()]).unwrap();
    let store = Store::new(spec.clone(), 1, 2).unwrap();
    let limit = 8 << 20;
    let ingress_config = IngressConfig { max_buffered_bytes: limit, ..IngressConfig::new(1, 2) };
    let tcp = TcpConfig {
        codecs: vec![Some(Codec::Zstd { level: 1 })],
        ..TcpConfig::new("127.0.0.1", 0)
    };
    let server = TcpIngress::start(Backend::Fifo(store), ingress_config, &tcp).unwrap();
    let addr = server.local_addr();
    let codecs = LeafCodecs::new(&spec, vec![Some(Codec::Zstd { level: 1 })]).unwrap();
    let declared = codecs.max_body() as u32;
    assert!(declared as usize > LEAF, "zstd's bound exceeds the raw leaf");
    let before = resident_bytes();
    let peers: Vec<TcpStream> = (0..PEERS)
        .map(|i| {
            let hello = v2::Hello {
                layout: Layout::untyped(&spec),
                ..common::tagged_hello(i as u8, false, true, true)
            };
            let (mut raw, accept) = common::raw_client_of(addr, &spec, hello);
            assert!(accept.codecs.is_some());
            raw.write_all(&packed_frame(declared, &[0x28, 0xB5, 0x2F, 0xFD, 0])).unwrap();
            raw
        })
        .collect();
    // Each holds exactly one step of its body; before the body counted, it held none of the
    // budget and all of `declared` bytes of memory.
    let step = 64 << 10;
    common::wait_until("every peer's partial body counted", || {
        server.snapshot().buffered_bytes == (PEERS * step) as u64
    });
    // Each peer's body and staging buffer (64 KiB each), the connections' tasks, and under
    // AddressSanitizer its shadow and quarantine: about 8 MiB here, under 30 with ASan; the
    // bodies allocated whole were 48 MiB more.
    let grown = resident_bytes().saturating_sub(before);
    assert!(
        grown < PEERS * LEAF * 3 / 4,
        "{PEERS} peers that sent 5 bytes each grew the learner by {grown} bytes"
    );
    assert!(server.snapshot().buffered_bytes <= limit as u64);
    drop(peers);
    common::wait_until("the bodies of the peers that left given back", || {
        server.snapshot().buffered_bytes == 0
    });
}

#[test]
fn a_compressed_frame_larger_than_the_byte_budget_is_refused_not_waited_for() {
    const LEAF: usize = 1 << 20;
    let spec = DataSpec::new(vec![ArraySpec::new(vec![LEAF], 1).unwrap()]).unwrap();
    let store = Store::new(spec.clone(), 1, 2).unwrap();
    // One sample fits; a sample and a body of its worst case do not.
    let ingress_config =
        IngressConfig { max_buffered_bytes: LEAF + LEAF / 2, ..IngressConfig::new(1, 2) };
    let tcp = TcpConfig { codecs: vec![Some(Codec::Lz4)], ..TcpConfig::new("127.0.0.1", 0) };
    let server = TcpIngress::start(Backend::Fifo(store), ingress_config, &tcp).unwrap();
    let hello =
        v2::Hello { layout: Layout::untyped(&spec), ..common::tagged_hello(1, false, true, true) };
    let (mut raw, _) = common::raw_client_of(server.local_addr(), &spec, hello);
    raw.write_all(&packed_frame((LEAF / 2 + 1) as u32, &[])).unwrap();
    let message = error_message(&mut raw);
    assert!(message.contains("max_buffered_bytes"), "{message}");
}
