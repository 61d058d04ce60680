//! The server without Python: in-process inserts and TCP clients into one backend, batches to
//! its consumer, exactly once; a draining close hands out what was acknowledged, a close at
//! once counts what never reached the learner; a second start and a start after the close
//! are refused.

mod common;

use std::time::Instant;

use common::{
    assert_exactly_once_in_order, decode, send_tagged, tagged_client, tagged_payload, tagged_spec,
    PATIENCE,
};
use echo::backend::BackendConfig;
use echo::server::{Server, ServerConfig};
use echo::transport::client::TcpSender;
use echo::transport::tcp::TcpConfig;
use echo::transport::wire::v2::Closing;
use echo::{EchoError, Payloads};

fn fifo(batch_size: usize, num_batches: usize) -> Server {
    let config = ServerConfig {
        backend: BackendConfig::Fifo { batch_size, num_batches },
        num_drainers: 2,
        producer_queue_size: Some(8),
        wire_codecs: Vec::new(),
        name: None,
        versions: None,
    };
    Server::new(tagged_spec(), config).unwrap()
}

fn loopback() -> TcpConfig {
    TcpConfig { num_threads: 2, ..TcpConfig::new("127.0.0.1", 0) }
}

/// Every (producer, seq) of the next batch, or the error that ended the wait.
fn next_batch(server: &Server) -> Result<Vec<(u32, u64)>, EchoError> {
    let deadline = Instant::now() + PATIENCE;
    let mut holdback = None;
    loop {
        let slice_end = (Instant::now() + std::time::Duration::from_millis(50)).min(deadline);
        if let Some(got) = server.sample_slice(slice_end, &mut holdback) {
            let (consumer, batch, snapshot) = got?;
            assert!(snapshot.payload_bytes > 0);
            let leaves: [Vec<u8>; 3] =
                std::array::from_fn(|leaf| consumer.read_leaf(&batch, leaf, <[u8]>::to_vec));
            let n = leaves[0].len() / 4;
            return Ok((0..n).map(|i| decode(&leaves, i)).collect());
        }
        assert!(Instant::now() < deadline, "no batch within {PATIENCE:?}");
    }
}

fn insert_tagged(server: &Server, producer: u32, seqs: std::ops::Range<u64>) {
    let payloads: Vec<_> = seqs.map(|seq| tagged_payload(producer, seq)).collect();
    let spec = tagged_spec();
    let source = Payloads::new(&spec, &payloads).unwrap();
    server.insert(&source, None, Some(Instant::now() + PATIENCE)).unwrap();
}

#[test]
fn in_process_and_tcp_samples_reach_the_consumer_exactly_once() {
    let server = fifo(4, 4);
    let port = server.start(loopback(), 1 << 20).unwrap();
    insert_tagged(&server, 0, 0..8);
    let mut client = TcpSender::connect(tagged_client(port), PATIENCE).unwrap();
    for seq in 0..8 {
        send_tagged(&mut client, 1, seq).unwrap();
    }
    assert!(client.close(Some(Instant::now() + PATIENCE)));
    let mut got = Vec::new();
    for _ in 0..4 {
        got.extend(next_batch(&server).unwrap());
    }
    assert_exactly_once_in_order(&got, 2, 8);
    let stats = server.snapshot();
    assert_eq!(stats.submitted, 8);
    assert_eq!(stats.ingress.samples_inserted_total, 8);
    assert_eq!(server.capacity(), 16);
}

#[test]
fn a_draining_close_hands_out_every_full_batch_then_closes() {
    let server = fifo(4, 4);
    let port = server.start(loopback(), 1 << 20).unwrap();
    let mut client = TcpSender::connect(tagged_client(port), PATIENCE).unwrap();
    for seq in 0..10 {
        send_tagged(&mut client, 0, seq).unwrap();
    }
    client.wait(Some(Instant::now() + PATIENCE)).unwrap();
    server.close(true, Closing::Final);
    assert!(server.is_closed_to_inserts());
    let mut got = next_batch(&server).unwrap();
    got.extend(next_batch(&server).unwrap());
    assert_eq!(got, (0..8).map(|seq| (0, seq)).collect::<Vec<_>>());
    // Two samples are left: fewer than a batch, and nothing more comes.
    assert!(matches!(next_batch(&server), Err(EchoError::Closed)));
    assert_eq!(server.dropped_at_close(), Some(2));
}

#[test]
fn a_close_at_once_counts_what_never_reached_the_learner() {
    let server = fifo(4, 4);
    insert_tagged(&server, 0, 0..6);
    assert_eq!(server.dropped_at_close(), None);
    server.close(false, Closing::Final);
    assert_eq!(server.dropped_at_close(), Some(6));
    assert!(matches!(next_batch(&server), Err(EchoError::Closed)));
    let spec = tagged_spec();
    let late = [tagged_payload(0, 6)];
    let refused = server.insert(&Payloads::new(&spec, &late).unwrap(), None, None);
    assert!(matches!(refused, Err(err) if matches!(err.error, EchoError::Closed)));
}

#[test]
fn a_second_start_and_a_start_after_close_are_refused() {
    let server = fifo(4, 2);
    server.start(loopback(), 1 << 20).unwrap();
    assert!(matches!(server.start(loopback(), 1 << 20), Err(EchoError::Config(_))));
    server.close(false, Closing::Final);
    let closed = fifo(4, 2);
    closed.close(false, Closing::Final);
    assert!(matches!(closed.start(loopback(), 1 << 20), Err(EchoError::Closed)));
}
