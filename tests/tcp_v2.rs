//! Wire protocol v2 over real loopback sockets: tokens, the typed layout check, sessions that
//! survive dropped connections exactly once and in order, and heartbeats that find a dead
//! peer. The Python suite covers the same with id-echo 0.2.1 and worker processes.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::{
    collect_tagged, send_tagged, start_tagged_fifo, tagged_client, tagged_payload, tagged_spec,
    wait_until, PATIENCE,
};
use echo::transport::client::{ClientConfig, Protocol, TcpSender};
use echo::transport::tcp::TcpConfig;
use echo::transport::wire::v2::{DType, Layout};
use echo::transport::TcpIngress;
use echo::{Consumer, EchoError};

fn start(tcp: TcpConfig, batch_size: usize) -> (Consumer, TcpIngress, SocketAddr) {
    start_tagged_fifo(&tcp, batch_size, 4, 8)
}

fn local() -> TcpConfig {
    TcpConfig::new("127.0.0.1", 0)
}

fn client(port: u16) -> ClientConfig {
    tagged_client(port)
}

#[test]
fn a_tokenserver_admits_only_clients_that_prove_the_token() {
    let tcp = TcpConfig { token: Some(b"s3cret".to_vec()), ..local() };
    let (mut consumer, server, addr) = start(tcp, 2);
    let refusals = [
        (ClientConfig { token: None, ..client(addr.port()) }, "requires a token"),
        (ClientConfig { token: Some(b"wrong".to_vec()), ..client(addr.port()) }, "wrong token"),
        (ClientConfig { protocol: Protocol::V1, ..client(addr.port()) }, "protocol=1"),
    ];
    for (config, expected) in refusals {
        match TcpSender::connect(config, PATIENCE) {
            Err(EchoError::Auth(msg)) => assert!(msg.contains(expected), "{msg}"),
            Err(other) => panic!("expected an Auth error with {expected:?}, got {other:?}"),
            Ok(_) => panic!("admitted without the right token ({expected})"),
        }
    }
    wait_until("the wrong token counted", || server.snapshot().handshakes_refused_auth_total == 1);
    let mut good = TcpSender::connect(
        ClientConfig { token: Some(b"s3cret".to_vec()), ..client(addr.port()) },
        PATIENCE,
    )
    .unwrap();
    assert_eq!(good.protocol(), 2);
    send_tagged(&mut good, 1, 0).unwrap();
    send_tagged(&mut good, 1, 1).unwrap();
    assert_eq!(collect_tagged(&mut consumer, 1), vec![(1, 0), (1, 1)]);
}

#[test]
fn a_client_with_a_token_refuses_a_server_that_cannot_prove_it() {
    let (_consumer, _server, addr) = start(local(), 2);
    let config = ClientConfig { token: Some(b"s3cret".to_vec()), ..client(addr.port()) };
    match TcpSender::connect(config, PATIENCE) {
        Err(EchoError::Auth(msg)) => assert!(msg.contains("did not prove the token"), "{msg}"),
        other => panic!("expected an Auth error, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn a_layout_mismatch_is_refused_naming_the_leaf_and_both_dtypes() {
    let mut typed = Layout::untyped(&tagged_spec());
    typed.0[1].dtype = DType { order: b'<', kind: b'u', size: 8 };
    typed.0[1].name = "['seq']".into();
    let tcp = TcpConfig { layout: Some(typed.clone()), ..local() };
    let (_consumer, server, addr) = start(tcp, 2);
    let mut theirs = typed.clone();
    theirs.0[1].dtype = DType { order: b'<', kind: b'f', size: 8 };
    match TcpSender::connect(ClientConfig::new("127.0.0.1", addr.port(), theirs), PATIENCE) {
        Err(EchoError::Protocol(msg)) => {
            assert!(
                msg.contains("['seq']") && msg.contains("uint64") && msg.contains("float64"),
                "{msg}"
            );
        }
        other => panic!("expected a layout refusal, got {:?}", other.map(|_| ())),
    }
    let mut renamed = typed.clone();
    renamed.0[1].name = "['step']".into();
    match TcpSender::connect(ClientConfig::new("127.0.0.1", addr.port(), renamed), PATIENCE) {
        Err(EchoError::Protocol(msg)) => assert!(msg.contains("['step']"), "{msg}"),
        other => panic!("expected a layout refusal, got {:?}", other.map(|_| ())),
    }
    assert_eq!(server.snapshot().handshakes_refused_layout_total, 2);
    // The same client as v1 sees only sizes and shapes, which match.
    let mut theirs = typed;
    theirs.0[1].dtype = DType { order: b'<', kind: b'f', size: 8 };
    let v1 = ClientConfig {
        protocol: Protocol::V1,
        ..ClientConfig::new("127.0.0.1", addr.port(), theirs)
    };
    assert_eq!(TcpSender::connect(v1, PATIENCE).unwrap().protocol(), 1);
}

/// A loopback proxy that cuts each connection after a number of client bytes (a different
/// number each time), or, once `black_hole` is set, stops forwarding but keeps the sockets.
struct Proxy {
    port: u16,
    cuts: Arc<AtomicUsize>,
    black_hole: Arc<AtomicBool>,
}

impl Proxy {
    fn start(target: SocketAddr, max_cuts: usize) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let cuts = Arc::new(AtomicUsize::new(0));
        let black_hole = Arc::new(AtomicBool::new(false));
        let (counter, hole) = (Arc::clone(&cuts), Arc::clone(&black_hole));
        thread::spawn(move || {
            for (k, client) in listener.incoming().enumerate().take(10_000) {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect(target) else { return };
                // Cut after 1..40 KB of client bytes, until `max_cuts` connections were cut.
                let limit = if counter.load(Relaxed) < max_cuts {
                    1_000 + (k * 7_919) % 40_000
                } else {
                    usize::MAX
                };
                let pumps = [
                    (client.try_clone().unwrap(), server.try_clone().unwrap(), limit),
                    (server, client, usize::MAX),
                ];
                for (mut from, mut to, limit) in pumps {
                    let (counter, hole) = (Arc::clone(&counter), Arc::clone(&hole));
                    thread::spawn(move || {
                        let mut buf = [0u8; 4096];
                        let mut moved = 0;
                        while let Ok(n) = from.read(&mut buf) {
                            if n == 0 {
                                break;
                            }
                            while hole.load(Relaxed) {
                                thread::sleep(Duration::from_millis(5));
                            }
                            let n = n.min(limit - moved);
                            if to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                            moved += n;
                            if moved >= limit {
                                counter.fetch_add(1, Relaxed);
                                break;
                            }
                        }
                        let _ = from.shutdown(Shutdown::Both);
                        let _ = to.shutdown(Shutdown::Both);
                    });
                }
            }
        });
        Self { port, cuts, black_hole }
    }
}

#[test]
fn reconnecting_clients_deliver_exactly_once_in_order_through_dropped_connections() {
    const PRODUCERS: u32 = 4;
    const PER_PRODUCER: u64 = 3_000;
    let (mut consumer, server, addr) = start(local(), 50);
    let proxy = Proxy::start(addr, 24);
    let senders: Vec<_> = (0..PRODUCERS)
        .map(|producer| {
            let config = ClientConfig {
                max_inflight: 16,
                reconnect_timeout: Some(PATIENCE),
                ..client(proxy.port)
            };
            thread::spawn(move || {
                let mut sender = TcpSender::connect(config, PATIENCE).unwrap();
                for seq in 0..PER_PRODUCER {
                    send_tagged(&mut sender, producer, seq).unwrap();
                }
                assert!(sender.close(Some(Instant::now() + PATIENCE)), "close did not flush");
                // Where the latest reconnect resumed: within what this sender sent.
                match (sender.reconnects(), sender.resumed_from()) {
                    (0, resumed) => assert_eq!(resumed, None),
                    (_, resumed) => assert!(resumed.is_some_and(|r| r <= PER_PRODUCER)),
                }
                (sender.reconnects(), sender.resent())
            })
        })
        .collect();
    let total = PRODUCERS as usize * PER_PRODUCER as usize;
    let got = collect_tagged(&mut consumer, total / 50);
    let mut next = [0u64; PRODUCERS as usize];
    for (p, s) in got {
        assert_eq!(s, next[p as usize], "producer {p}: lost, duplicated or reordered");
        next[p as usize] += 1;
    }
    let reconnects: u64 = senders.into_iter().map(|s| s.join().unwrap().0).sum();
    assert!(proxy.cuts.load(Relaxed) > 0 && reconnects > 0, "no connection was ever cut");
    let snap = server.snapshot();
    assert_eq!(snap.sessions_resumed_total, reconnects);
    assert_eq!(snap.samples_inserted_total, total as u64);
}

#[test]
fn heartbeats_find_a_silent_server_within_the_timeout() {
    let (_consumer, _server, addr) = start(local(), 2);
    let proxy = Proxy::start(addr, 0);
    let config =
        ClientConfig { heartbeat_timeout: Some(Duration::from_millis(400)), ..client(proxy.port) };
    let mut sender = TcpSender::connect(config, PATIENCE).unwrap();
    send_tagged(&mut sender, 0, 0).unwrap();
    sender.wait(Some(Instant::now() + PATIENCE)).unwrap();
    proxy.black_hole.store(true, Relaxed);
    let started = Instant::now();
    match sender.wait(Some(Instant::now() + PATIENCE)).and_then(|()| send_tagged(&mut sender, 0, 1))
    {
        Ok(()) => {
            // The send went into the socket buffer; its ack never comes.
            match sender.wait(Some(Instant::now() + PATIENCE)) {
                Err(EchoError::Disconnected(msg)) => assert!(msg.contains("heartbeat"), "{msg}"),
                other => panic!("expected a dead server, got {other:?}"),
            }
        }
        Err(EchoError::Disconnected(msg)) => assert!(msg.contains("heartbeat"), "{msg}"),
        Err(other) => panic!("{other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
}

#[test]
fn the_server_drops_a_v2_client_that_goes_silent() {
    let tcp = TcpConfig { heartbeat_timeout: Some(Duration::from_millis(300)), ..local() };
    let (_consumer, server, addr) = start(tcp, 2);
    let proxy = Proxy::start(addr, 0);
    // A client that never sends heartbeats itself (its own timeout is off) and whose bytes
    // stop at the proxy: the server must give up on it.
    let config = ClientConfig { heartbeat_timeout: None, ..client(proxy.port) };
    let mut sender = TcpSender::connect(config, PATIENCE).unwrap();
    wait_until("the connection served", || server.snapshot().v2_connections_total == 1);
    proxy.black_hole.store(true, Relaxed);
    let started = Instant::now();
    // The server's heartbeats stop at the proxy too; what ends the wait is the server
    // closing the connection, which the proxy passes on once its hole closes.
    thread::sleep(Duration::from_millis(1_000));
    proxy.black_hole.store(false, Relaxed);
    match sender.wait(Some(Instant::now() + PATIENCE)).and_then(|()| {
        send_tagged(&mut sender, 0, 0)?;
        sender.wait(Some(Instant::now() + PATIENCE))
    }) {
        Err(EchoError::Disconnected(_)) => {}
        other => panic!("the server kept a silent client: {other:?}"),
    }
    assert!(started.elapsed() < PATIENCE);
}

#[test]
fn a_hello_that_arrives_slowly_after_its_nonce_is_still_a_hello() {
    use echo::transport::wire::v2::SAMPLE;
    let (mut consumer, _server, addr) = start(local(), 1);
    let (mut raw, offer) = greeted(addr);
    let bytes = hello(3, false).encode(&offer, None).unwrap();
    // The nonce and a little more, then a pause far longer than the 200 ms a prefix of the
    // nonce gets before it is taken for v1 data: a whole nonce is a hello for sure.
    raw.write_all(&bytes[..40]).unwrap();
    thread::sleep(Duration::from_millis(600));
    raw.write_all(&bytes[40..]).unwrap();
    accepted(&mut raw);
    let mut frame = vec![SAMPLE];
    frame.extend_from_slice(&tagged_payload(9, 0));
    raw.write_all(&frame).unwrap();
    assert_eq!(collect_tagged(&mut consumer, 1), vec![(9, 0)]);
}

/// A raw connection to `addr` that has read the server's greeting; and its v2 offer.
fn greeted(addr: SocketAddr) -> (TcpStream, echo::transport::wire::v2::Offer) {
    use echo::transport::wire::encode_handshake;
    use echo::transport::wire::v2::{Offer, OFFER_LEN};
    let mut raw = TcpStream::connect(addr).unwrap();
    raw.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut greeting = vec![0u8; encode_handshake(&tagged_spec()).unwrap().len() + OFFER_LEN];
    raw.read_exact(&mut greeting).unwrap();
    let offer = Offer::parse(&greeting[greeting.len() - OFFER_LEN..]).unwrap().unwrap();
    (raw, offer)
}

/// An untokened hello of session `[session; 16]` for the tagged layout.
fn hello(session: u8, notices: bool) -> echo::transport::wire::v2::Hello {
    common::tagged_hello(session, false, notices, false)
}

/// Reads the server's reply byte by byte and checks that it accepted.
fn accepted(raw: &mut TcpStream) {
    use echo::transport::wire::v2::Reply;
    let mut reply = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        raw.read_exact(&mut byte).unwrap();
        reply.push(byte[0]);
        if let Some((reply, _)) = Reply::parse(&reply).unwrap() {
            assert!(matches!(reply, Reply::Accepted(_)), "{reply:?}");
            return;
        }
    }
}

/// A raw v2 connection of session `[session; 16]`, accepted, with the closing-notices flag
/// as `notices` says.
fn raw_v2(addr: SocketAddr, session: u8, notices: bool) -> TcpStream {
    let (mut raw, offer) = greeted(addr);
    raw.write_all(&hello(session, notices).encode(&offer, None).unwrap()).unwrap();
    accepted(&mut raw);
    raw
}

#[test]
fn a_closingserver_acks_what_it_queued_then_says_why_only_to_clients_that_understand() {
    use echo::transport::wire::v2::{Closing, ACK, CLOSING, SAMPLE};
    for why in [Closing::Final, Closing::Restarting] {
        let (_consumer, mut server, addr) = start(local(), 64);
        let mut told = raw_v2(addr, 1, true);
        let mut untold = raw_v2(addr, 2, false);
        for raw in [&mut told, &mut untold] {
            for seq in 0..3 {
                let mut frame = vec![SAMPLE];
                frame.extend_from_slice(&tagged_payload(1, seq));
                raw.write_all(&frame).unwrap();
            }
        }
        wait_until("both connections' samples queued", || {
            server.snapshot().samples_pending + server.snapshot().samples_inserted_total >= 6
        });
        server.stop_accepting(why);
        for (raw, tail) in [(&mut told, vec![CLOSING, why as u8]), (&mut untold, vec![])] {
            let mut rest = Vec::new();
            raw.read_to_end(&mut rest).unwrap(); // the server half-closes after the notice
            let mut expected = vec![ACK; 3];
            expected.extend_from_slice(&tail);
            assert_eq!(rest, expected, "{why:?}: every ack, then the notice (if understood)");
        }
        assert!(TcpStream::connect(addr).is_err(), "{why:?}: a closed server accepts nobody");
    }
}

#[test]
fn a_gone_connection_ends_only_the_streams_it_used_however_high_their_rows() {
    use echo::backend::Backend;
    use echo::ingress::IngressConfig;
    use echo::replay::{ReplayConfig, SequenceConfig, SequenceTable};
    use echo::transport::wire::v2::FrameMeta;
    // Rows up to 2^30 allowed; a client steps on row 0 and on row 2^30 - 1, then goes. Its
    // streams end by walking the two the table holds, not the 2^30 rows up to the highest
    // (one lock and lookup each: seconds of a drainer's time, with every other connection's
    // steps waiting behind it).
    let high = (1u32 << 30) - 1;
    let sequence = SequenceConfig { max_streams: high as usize + 1, ..SequenceConfig::new(2) };
    let table =
        SequenceTable::new(common::tagged_spec(), ReplayConfig::new(2, 64), sequence).unwrap();
    let ingress = TcpIngress::start(
        Backend::Sequence(table.clone()),
        IngressConfig::new(1, 8),
        &TcpConfig::new("127.0.0.1", 0),
    )
    .unwrap();
    let mut client =
        TcpSender::connect(tagged_client(ingress.local_addr().port()), PATIENCE).unwrap();
    for (seq, row) in [(0, 0), (1, high), (2, high)] {
        let p = common::tagged_payload(1, seq);
        let meta = FrameMeta { row, ..FrameMeta::default() };
        client
            .send(&[&p[..4], &p[4..12], &p[12..]], meta, Some(Instant::now() + PATIENCE))
            .unwrap();
    }
    client.wait(Some(Instant::now() + PATIENCE)).unwrap();
    common::wait_until("both rows' streams open", || table.stats().streams_open == 2);
    assert!(client.close(Some(Instant::now() + PATIENCE)));
    common::wait_until("the gone connection's streams ended", || {
        let stats = table.stats();
        stats.streams_open == 0 && stats.episodes_ended == 2
    });
}

#[test]
fn the_streams_a_connection_opens_count_in_max_buffered_bytes_until_they_end() {
    use echo::backend::Backend;
    use echo::ingress::IngressConfig;
    use echo::replay::{ReplayConfig, SequenceConfig, SequenceTable};
    use echo::transport::wire::v2::FrameMeta;
    // A byte budget that holds this connection's buffers and 64 streams: a client that steps
    // on 200 rows gets 64 streams into the table, then waits for budget (its own streams
    // hold it); when its session is gone the table forgets them and the budget is whole.
    const QUEUE: usize = 8;
    let sequence = SequenceConfig { max_streams: 1024, ..SequenceConfig::new(2) };
    let table =
        SequenceTable::new(common::tagged_spec(), ReplayConfig::new(2, 4096), sequence).unwrap();
    let cost = table.stream_cost();
    let buffers = (2 * QUEUE + 1) * common::TAGGED_PAYLOAD;
    let ingress_config =
        IngressConfig { max_buffered_bytes: buffers + 64 * cost, ..IngressConfig::new(1, QUEUE) };
    let tcp = TcpConfig {
        session_timeout: Duration::from_millis(50),
        shared_memory: false,
        ..TcpConfig::new("127.0.0.1", 0)
    };
    let ingress =
        TcpIngress::start(Backend::Sequence(table.clone()), ingress_config, &tcp).unwrap();
    let mut client =
        TcpSender::connect(tagged_client(ingress.local_addr().port()), PATIENCE).unwrap();
    for row in 0..200u32 {
        let p = common::tagged_payload(1, u64::from(row));
        let meta = FrameMeta { row, ..FrameMeta::default() };
        // Past 64 rows the server stops reading: the client's window fills and a send
        // times out (the steps sent so far are enough).
        let sent = client.send(
            &[&p[..4], &p[4..12], &p[12..]],
            meta,
            Some(Instant::now() + Duration::from_millis(200)),
        );
        if sent.is_err() {
            break;
        }
    }
    common::wait_until("64 streams in, the connection waiting for budget", || {
        table.stats().streams_open == 64 && ingress.snapshot().push_blocked_count > 0
    });
    assert_eq!(table.stats().streams_open, 64, "no stream past what the budget holds");
    assert!(ingress.snapshot().buffered_bytes >= (64 * cost) as u64);
    drop(client);
    common::wait_until("the gone session's streams ended and their bytes given back", || {
        table.stats().streams_open == 0 && ingress.snapshot().buffered_bytes == 0
    });
}

/// Reads the server's reply to a hello byte by byte.
fn reply(raw: &mut TcpStream) -> echo::transport::wire::v2::Reply {
    use echo::transport::wire::v2::Reply;
    let mut reply = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        raw.read_exact(&mut byte).unwrap();
        reply.push(byte[0]);
        if let Some((reply, _)) = Reply::parse(&reply).unwrap() {
            return reply;
        }
    }
}

/// Sends the hello of session `[session; 16]` claiming `first_seq` on a new connection;
/// the connection and the server's reply.
fn resume(
    addr: SocketAddr,
    session: u8,
    first_seq: u64,
) -> (TcpStream, echo::transport::wire::v2::Reply) {
    let (mut raw, offer) = greeted(addr);
    let hello = echo::transport::wire::v2::Hello { first_seq, ..hello(session, true) };
    raw.write_all(&hello.encode(&offer, None).unwrap()).unwrap();
    let reply = reply(&mut raw);
    (raw, reply)
}

/// Sends samples `seqs` of producer 1 and reads their acks.
fn send_acked(raw: &mut TcpStream, seqs: std::ops::Range<u64>) {
    use echo::transport::wire::v2::{ACK, SAMPLE};
    let n = usize::try_from(seqs.end - seqs.start).unwrap();
    for seq in seqs {
        let mut frame = vec![SAMPLE];
        frame.extend_from_slice(&tagged_payload(1, seq));
        raw.write_all(&frame).unwrap();
    }
    let mut acks = vec![0u8; n];
    raw.read_exact(&mut acks).unwrap();
    assert_eq!(acks, vec![ACK; n]);
}

#[test]
fn a_resume_may_claim_only_what_its_session_acknowledged_and_a_refused_one_cuts_nobody_off() {
    use echo::transport::wire::v2::{Refusal, Reply};
    let (mut consumer, _server, addr) = start(local(), 1);
    let mut owner = raw_v2(addr, 7, true);
    send_acked(&mut owner, 0..3);
    // Past what was queued: taking it would move the resume point and drop what the client
    // still holds.
    let (_stranger, refused) = resume(addr, 7, 1_000_000_000_000);
    let Reply::Refused(Refusal::Protocol, message) = refused else { panic!("{refused:?}") };
    assert!(
        message.contains("sample 1000000000000") && message.contains("queued only 3 samples"),
        "{message}"
    );
    // The client that owns the session was not cut off.
    send_acked(&mut owner, 3..5);
    drop(owner);
    // Its reconnect resumes where the session is; once a sample came on that connection, the
    // client knows the resume point and a claim below it is no client's.
    let (mut owner, accepted) = resume(addr, 7, 4);
    let Reply::Accepted(accept) = accepted else { panic!("{accepted:?}") };
    assert_eq!(accept.resume_seq, 5);
    send_acked(&mut owner, 5..6);
    let (_stranger, refused) = resume(addr, 7, 2);
    let Reply::Refused(Refusal::Protocol, message) = refused else { panic!("{refused:?}") };
    assert!(message.contains("before 5") && message.contains("claim 5 to 6"), "{message}");
    send_acked(&mut owner, 6..7);
    let got = collect_tagged(&mut consumer, 7);
    assert_eq!(got, (0..7).map(|seq| (1, seq)).collect::<Vec<_>>());
}

/// Where the client of the next test connects: the targets in turn, one step on each time
/// the connection to the current one ended.
struct Rotation {
    targets: Vec<u16>,
    at: std::sync::Mutex<usize>,
}

impl echo::transport::client::Resolve for Rotation {
    fn resolve(&self, last: Option<(&str, u16, &str)>) -> Result<Option<(String, u16)>, EchoError> {
        let mut at = self.at.lock().unwrap();
        if last.is_some_and(|(_, port, _)| port == self.targets[*at])
            && *at + 1 < self.targets.len()
        {
            *at += 1;
        }
        Ok(Some(("127.0.0.1".into(), self.targets[*at])))
    }
}

/// A client whose resolver sends it to another server starts a new session there, and again
/// when it is sent back to a server it left: server A still holds the first session (detached,
/// with what A acknowledged of it), and a resume of that session claiming what B acknowledged
/// since would be refused. Every sample reaches one of the two servers; the few in flight at a
/// move may reach both (a move between servers is at-least-once, as the TCP guide says).
#[test]
fn a_client_moved_to_anotherserver_and_back_starts_a_new_session_each_time() {
    const SAMPLES: u64 = 900;
    let (consumer_a, server_a, addr_a) = start(local(), 1);
    let (consumer_b, server_b, addr_b) = start(local(), 1);
    // Each server's consumer takes batches as they come (its ring is small) until told to stop
    // and nothing more arrives.
    let stop = Arc::new(AtomicBool::new(false));
    let drain = |mut consumer: Consumer| {
        let stop = Arc::clone(&stop);
        thread::spawn(move || {
            let mut got = Vec::new();
            loop {
                let deadline = Instant::now() + Duration::from_millis(100);
                match consumer.sample(Some(deadline)) {
                    Ok(_) => got.push(common::decode(&common::batch_leaves(&consumer), 0)),
                    Err(_) if stop.load(Relaxed) => return got,
                    Err(_) => {}
                }
            }
        })
    };
    let (drain_a, drain_b) = (drain(consumer_a), drain(consumer_b));
    // A through a proxy that cuts the first connection, then B the same way, then A directly.
    let (proxy_a, proxy_b) = (Proxy::start(addr_a, 1), Proxy::start(addr_b, 1));
    let rotation = Rotation {
        targets: vec![proxy_a.port, proxy_b.port, addr_a.port()],
        at: std::sync::Mutex::new(0),
    };
    let config = ClientConfig {
        max_inflight: 8,
        reconnect_timeout: Some(PATIENCE),
        resolver: Some(echo::transport::client::Resolver(Arc::new(rotation))),
        ..client(0)
    };
    let mut sender = TcpSender::connect(config, PATIENCE).unwrap();
    for seq in 0..SAMPLES {
        send_tagged(&mut sender, 0, seq).unwrap();
    }
    assert!(sender.close(Some(Instant::now() + PATIENCE)), "close did not flush");
    assert_eq!(sender.reconnects(), 2, "cut by proxy A, then by proxy B");
    assert_eq!((proxy_a.cuts.load(Relaxed), proxy_b.cuts.load(Relaxed)), (1, 1));
    // Everything acknowledged is in A's or B's queue, and reaches its consumer.
    let mut seen = std::collections::HashSet::new();
    let deadline = Instant::now() + PATIENCE;
    let (got_a, got_b) = loop {
        thread::sleep(Duration::from_millis(200));
        if Instant::now() > deadline {
            break (Vec::new(), Vec::new());
        }
        if server_a.snapshot().samples_pending == 0 && server_b.snapshot().samples_pending == 0 {
            stop.store(true, Relaxed);
            break (drain_a.join().unwrap(), drain_b.join().unwrap());
        }
    };
    let mut total = 0;
    for (producer, seq) in got_a.iter().chain(&got_b) {
        assert_eq!(*producer, 0);
        assert!(*seq < SAMPLES);
        seen.insert(*seq);
        total += 1;
    }
    assert!(!got_b.is_empty(), "B took the samples sent while the client was there");
    assert_eq!(seen.len(), SAMPLES as usize, "every sample reached A or B");
    let twice = total - seen.len();
    assert!(twice <= 2 * 8, "{twice} samples twice: more than were in flight at the two moves");
}
