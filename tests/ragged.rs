//! The ragged table end to end: exactly-once FIFO delivery of variable-length samples under
//! contention, whole groups, token budgets, both layouts, replay eviction by bytes, and the
//! refusals that store nothing.

use std::collections::HashSet;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use echo::ragged::{
    BatchLayout, ColumnData, GroupBatch, LeafDecl, RaggedBatch, RaggedConfig, RaggedDecl,
    RaggedSampler, RaggedSpec, RaggedTable, SampleIn, DROPPED,
};
use echo::versions::{Admission, VersionsConfig};
use echo::{ArraySpec, EchoError};

/// `tokens` (int32, ragged, group "completion"), `logp` (float32, same group), `id` (u64).
fn spec() -> RaggedSpec {
    let ragged = |name: &str| LeafDecl {
        name: name.into(),
        array: ArraySpec::new(vec![], 4).unwrap(),
        ragged: Some(RaggedDecl { max_len: 300, group: Some("completion".into()) }),
    };
    RaggedSpec::new(vec![
        ragged("['tokens']"),
        ragged("['logp']"),
        LeafDecl { name: "['id']".into(), array: ArraySpec::new(vec![], 8).unwrap(), ragged: None },
    ])
    .unwrap()
}

fn config(sampler: RaggedSampler, batch_size: usize, max_size: usize) -> RaggedConfig {
    RaggedConfig {
        sampler,
        batch_size,
        max_size,
        max_bytes: None,
        batch_tokens: None,
        min_size: 1,
        max_times_sampled: 0,
        seed: Some(7),
        codecs: Vec::new(),
        versions: None,
    }
}

/// A sample's bytes: `len` tokens `id * 1000 + row`, log-probabilities `-row`, and the id.
struct Made {
    tokens: Vec<u8>,
    logp: Vec<u8>,
    id: [u8; 8],
    len: usize,
}

fn make(id: u64, len: usize) -> Made {
    let tokens = (0..len).flat_map(|r| ((id * 1000 + r as u64) as i32).to_le_bytes()).collect();
    let logp = (0..len).flat_map(|r| (-(r as f32)).to_le_bytes()).collect();
    Made { tokens, logp, id: id.to_le_bytes(), len }
}

impl Made {
    fn sample(&self) -> SampleIn<'_> {
        SampleIn {
            leaves: vec![&self.tokens, &self.logp, &self.id],
            rows: vec![self.len, self.len, 1],
        }
    }
}

fn length_of(id: u64) -> usize {
    (id * 37 % 301) as usize
}

fn ids(batch: &RaggedBatch) -> Vec<u64> {
    batch
        .column_bytes(2)
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn i32s(raw: &[u8]) -> Vec<i32> {
    raw.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Every sample of a packed batch holds exactly what was inserted for its id.
fn check_packed(batch: &RaggedBatch) -> Vec<u64> {
    let ids = ids(batch);
    let GroupBatch::Packed { cu_seqlens } = &batch.groups[0] else { panic!("packed") };
    assert_eq!(cu_seqlens.len(), batch.samples + 1);
    let tokens = i32s(batch.column_bytes(0));
    assert_eq!(tokens.len(), *cu_seqlens.last().unwrap() as usize);
    for (i, &id) in ids.iter().enumerate() {
        let (a, b) = (cu_seqlens[i] as usize, cu_seqlens[i + 1] as usize);
        assert_eq!(b - a, length_of(id), "sample {id}'s length");
        for (r, &t) in tokens[a..b].iter().enumerate() {
            assert_eq!(t, (id * 1000 + r as u64) as i32, "sample {id} row {r}");
        }
    }
    ids
}

#[test]
fn fifo_hands_every_sample_out_exactly_once_under_contention() {
    let mut cfg = config(RaggedSampler::Fifo, 16, 64);
    // A small arena: writers wait for the consumer, blocks are reused all the time.
    cfg.max_bytes = Some(256 * 1024);
    let table = Arc::new(RaggedTable::new(spec(), cfg).unwrap());
    let writers: Vec<_> = (0..3u64)
        .map(|w| {
            let table = table.clone();
            thread::spawn(move || {
                for i in 0..2000u64 {
                    let made = make(w * 100_000 + i, length_of(w * 100_000 + i));
                    table.insert_group(&[made.sample()], None, None).unwrap();
                }
            })
        })
        .collect();
    let closer = {
        let table = table.clone();
        thread::spawn(move || {
            for w in writers {
                w.join().unwrap();
            }
            table.close(true);
        })
    };
    let mut seen = HashSet::new();
    let deadline = Some(Instant::now() + Duration::from_secs(60));
    while let Some(batch) = table.sample(BatchLayout::Packed, deadline).unwrap() {
        assert!(batch.samples <= 16);
        for id in check_packed(&batch) {
            assert!(seen.insert(id), "sample {id} handed out twice");
        }
    }
    closer.join().unwrap();
    assert_eq!(seen.len(), 6000);
    assert_eq!(table.stats().inserted, 6000);
}

#[test]
fn consecutive_fifo_samples_are_handed_out_without_a_copy() {
    let table = RaggedTable::new(spec(), config(RaggedSampler::Fifo, 4, 8)).unwrap();
    for id in 0..4 {
        table.insert_group(&[make(id, 10).sample()], None, None).unwrap();
    }
    let batch = table.sample(BatchLayout::Packed, None).unwrap().unwrap();
    assert!(matches!(batch.columns[0].data, ColumnData::View { len: 160, .. }));
    assert_eq!(batch.columns[0].lead, vec![40]);
    assert!(matches!(batch.columns[2].data, ColumnData::View { len: 32, .. }));
}

#[test]
fn groups_stay_whole_and_token_budgets_close_batches() {
    let mut cfg = config(RaggedSampler::Fifo, 12, 48);
    cfg.batch_tokens = Some((0, 1000));
    let table = Arc::new(RaggedTable::new(spec(), cfg).unwrap());
    let writer = {
        let table = table.clone();
        thread::spawn(move || {
            for g in 0..100u64 {
                let made: Vec<Made> =
                    (0..4).map(|k| make(g * 4 + k, length_of(g * 4 + k))).collect();
                let samples: Vec<SampleIn<'_>> = made.iter().map(Made::sample).collect();
                table.insert_group(&samples, None, None).unwrap();
            }
        })
    };
    let closer = {
        let table = table.clone();
        thread::spawn(move || {
            writer.join().unwrap();
            table.close(true);
        })
    };
    let mut seen = 0;
    let deadline = Some(Instant::now() + Duration::from_secs(60));
    while let Some(batch) = table.sample(BatchLayout::Packed, deadline).unwrap() {
        let ids = check_packed(&batch);
        assert!(ids.len() <= 12 && ids.len() % 4 == 0, "{} samples", ids.len());
        for group in ids.chunks(4) {
            assert!(group.iter().all(|&id| id / 4 == group[0] / 4), "split group {group:?}");
        }
        let GroupBatch::Packed { cu_seqlens } = &batch.groups[0] else { panic!() };
        assert!(*cu_seqlens.last().unwrap() <= 1000);
        seen += ids.len();
    }
    closer.join().unwrap();
    assert_eq!(seen, 400);
}

#[test]
fn padded_batches_have_zeros_past_each_length_and_a_mask() {
    let table = RaggedTable::new(spec(), config(RaggedSampler::Fifo, 3, 6)).unwrap();
    for (id, len) in [(1u64, 3usize), (2, 0), (3, 5)] {
        table.insert_group(&[make(id, len).sample()], None, None).unwrap();
    }
    let batch = table.sample(BatchLayout::Padded { multiple: 4 }, None).unwrap().unwrap();
    let GroupBatch::Padded { len, lengths, mask } = &batch.groups[0] else { panic!() };
    assert_eq!((*len, lengths.as_slice()), (8, [3, 0, 5].as_slice()));
    assert_eq!(batch.columns[0].lead, vec![3, 8]);
    let tokens = i32s(batch.column_bytes(0));
    assert_eq!(&tokens[0..8], &[1000, 1001, 1002, 0, 0, 0, 0, 0]);
    assert_eq!(&tokens[8..16], &[0; 8]);
    assert_eq!(&tokens[16..24], &[3000, 3001, 3002, 3003, 3004, 0, 0, 0]);
    assert_eq!(mask.iter().filter(|m| **m).count(), 8);
    assert!(mask[16..21].iter().all(|m| *m) && !mask[21]);
}

#[test]
fn bad_samples_are_refused_with_names_and_numbers_and_nothing_is_stored() {
    let mut cfg = config(RaggedSampler::Fifo, 4, 8);
    cfg.batch_tokens = Some((0, 500));
    let table = RaggedTable::new(spec(), cfg).unwrap();
    let long = make(1, 301);
    let err = table.insert_group(&[long.sample()], None, None).unwrap_err().to_string();
    assert!(err.contains("['tokens']: 301 rows, more than its max_len 300"), "{err}");
    let mut uneven = make(2, 10);
    uneven.logp.truncate(36);
    let mut sample = uneven.sample();
    sample.rows[1] = 9;
    let err = table.insert_group(&[sample], None, None).unwrap_err().to_string();
    assert!(
        err.contains("\"completion\"") && err.contains("has 10 rows but leaf ['logp'] has 9"),
        "{err}"
    );
    let made: Vec<Made> = (0..2).map(|i| make(i, 260)).collect();
    let samples: Vec<SampleIn<'_>> = made.iter().map(Made::sample).collect();
    let err = table.insert_group(&samples, None, None).unwrap_err().to_string();
    assert!(err.contains("a group of 2 samples with 520 rows") && err.contains("500"), "{err}");
    let made: Vec<Made> = (0..5).map(|i| make(i, 1)).collect();
    let samples: Vec<SampleIn<'_>> = made.iter().map(Made::sample).collect();
    let err = table.insert_group(&samples, None, None).unwrap_err().to_string();
    assert!(err.contains("a group of 5 samples is larger than a batch (batch_size 4)"), "{err}");
    assert!(matches!(table.insert_group(&[], None, None), Err(EchoError::Sample(_))));
    assert_eq!(table.stats().samples, 0);
    assert_eq!(table.stats().payload_bytes, 0);
}

#[test]
fn replay_evicts_the_oldest_by_bytes_and_memory_stays_near_the_payload() {
    let mut cfg = config(RaggedSampler::Uniform, 32, 100_000);
    cfg.max_bytes = Some(16 << 20);
    let table = RaggedTable::new(spec(), cfg).unwrap();
    for id in 0..20_000u64 {
        table.insert_group(&[make(id, length_of(id)).sample()], None, None).unwrap();
    }
    let stats = table.stats();
    assert!(stats.evicted > 0, "16 MiB cannot hold 20,000 samples of ~1.2 kB");
    assert!(stats.arena_bytes_in_use <= 16 << 20);
    let ratio = stats.arena_bytes_in_use as f64 / stats.payload_bytes as f64;
    assert!(ratio <= 1.25, "blocks in use / payload = {ratio}");
    let batch = table.sample(BatchLayout::Packed, None).unwrap().unwrap();
    let oldest = 20_000 - stats.samples as u64;
    for id in check_packed(&batch) {
        assert!(id >= oldest, "sample {id} should have been evicted");
    }
    assert_eq!(batch.probabilities.len(), batch.samples);
    assert!(batch.times_sampled.iter().all(|&t| t >= 1));
}

#[test]
fn prioritized_replay_draws_by_priority_and_takes_updates() {
    let table =
        RaggedTable::new(spec(), config(RaggedSampler::Prioritized { exponent: 1.0 }, 8, 16))
            .unwrap();
    let mut keys = Vec::new();
    for id in 0..4u64 {
        let priority = if id == 3 { 1.0 } else { 0.0 };
        keys.push(table.insert_group(&[make(id, 5).sample()], Some(priority), None).unwrap());
    }
    let batch = table.sample(BatchLayout::Packed, None).unwrap().unwrap();
    assert!(ids(&batch).iter().all(|&id| id == 3), "{:?}", ids(&batch));
    assert_eq!(table.update_priorities(&[keys[3], keys[1]], &[0.0, 2.0]).unwrap(), 2);
    let batch = table.sample(BatchLayout::Packed, None).unwrap().unwrap();
    assert!(ids(&batch).iter().all(|&id| id == 1));
    assert!(table.update_priorities(&[keys[0]], &[-1.0]).is_err());
}

#[test]
fn fifo_sample_times_out_and_close_ends_it() {
    let table = RaggedTable::new(spec(), config(RaggedSampler::Fifo, 4, 8)).unwrap();
    table.insert_group(&[make(1, 3).sample()], None, None).unwrap();
    let deadline = Some(Instant::now() + Duration::from_millis(50));
    assert!(matches!(table.sample(BatchLayout::Packed, deadline), Err(EchoError::TimedOut)));
    table.close(false);
    assert!(table.sample(BatchLayout::Packed, None).unwrap().is_none());
    assert!(matches!(
        table.insert_group(&[make(2, 3).sample()], None, None),
        Err(EchoError::Closed)
    ));
}

mod over_tcp {
    use std::collections::HashSet;
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::thread;
    use std::time::{Duration, Instant};

    use echo::ragged::client::{RaggedSender, SenderOptions};
    use echo::ragged::tcp::{RaggedTcp, TcpOptions};
    use echo::ragged::wire::{ragged_dims, Outgoing};
    use echo::ragged::{BatchLayout, RaggedSampler, RaggedTable};
    use echo::transport::wire::v2::{self, Closing, DType, Layout, LeafType};
    use echo::EchoError;

    use super::{check_packed, config, length_of, make, spec};

    fn layout() -> Layout {
        let int32 = DType { order: b'<', kind: b'i', size: 4 };
        let leaf =
            |name: &str, dtype, shape: Vec<usize>| LeafType { name: name.into(), dtype, shape };
        Layout(vec![
            // One length group, whose first leaf is the first.
            leaf("['tokens']", int32, ragged_dims(300, 0, &[])),
            leaf("['logp']", DType { order: b'<', kind: b'f', size: 4 }, ragged_dims(300, 0, &[])),
            leaf("['id']", DType { order: b'<', kind: b'u', size: 8 }, vec![]),
        ])
    }

    fn serve(batch: usize, token: Option<&[u8]>) -> (Arc<RaggedTable>, RaggedTcp) {
        serve_within(batch, token, 1 << 30)
    }

    /// A server whose connections may hold at most `budget` bytes of frames being read.
    fn serve_within(
        batch: usize,
        token: Option<&[u8]>,
        budget: usize,
    ) -> (Arc<RaggedTable>, RaggedTcp) {
        serve_with(batch, token, budget, false)
    }

    /// [`serve_within`], offering shared memory if `shm`.
    fn serve_with(
        batch: usize,
        token: Option<&[u8]>,
        budget: usize,
        shm: bool,
    ) -> (Arc<RaggedTable>, RaggedTcp) {
        let table = Arc::new(
            RaggedTable::new(spec(), config(RaggedSampler::Fifo, batch, 4 * batch)).unwrap(),
        );
        let options = TcpOptions {
            token: token.map(<[u8]>::to_vec),
            max_connections: 64,
            max_buffered_bytes: budget,
            shared_memory: shm,
            ..TcpOptions::default()
        };
        let tcp = RaggedTcp::start(table.clone(), layout(), "127.0.0.1", 0, options).unwrap();
        (table, tcp)
    }

    fn connect(port: u16, token: Option<&[u8]>) -> Result<RaggedSender, EchoError> {
        connect_with(port, token, Some(false))
    }

    fn connect_with(
        port: u16,
        token: Option<&[u8]>,
        shared_memory: Option<bool>,
    ) -> Result<RaggedSender, EchoError> {
        let options = SenderOptions {
            token: token.map(<[u8]>::to_vec),
            timeout: Duration::from_secs(5),
            max_inflight: 64,
            shared_memory,
            ..SenderOptions::default()
        };
        RaggedSender::connect("127.0.0.1", port, spec(), layout(), options)
    }

    /// Sends the samples `ids` (each [`make`] of its [`length_of`]) as one group.
    fn send_group(sender: &RaggedSender, ids: std::ops::Range<u64>) -> Result<(), EchoError> {
        let made: Vec<_> = ids.map(|id| make(id, length_of(id))).collect();
        let rows: Vec<[usize; 3]> = made.iter().map(|m| [m.len, m.len, 1]).collect();
        let leaves: Vec<[&[u8]; 3]> =
            made.iter().map(|m| [&m.tokens[..], &m.logp[..], &m.id[..]]).collect();
        let out: Vec<Outgoing<'_>> =
            rows.iter().zip(&leaves).map(|(r, l)| Outgoing { rows: r, leaves: l }).collect();
        sender.send_group(&out, None, None, None)
    }

    #[test]
    fn workers_deliver_every_sample_and_group_exactly_once() {
        deliver_exactly_once(1 << 30, false, 0);
    }

    #[test]
    fn a_byte_budget_smaller_than_one_frame_still_delivers_everything() {
        // 4 KiB: most frames are larger, so they are read one at a time.
        deliver_exactly_once(4096, false, 0);
    }

    #[test]
    fn workers_that_reconnect_after_cut_connections_deliver_every_sample_exactly_once() {
        // Connections cut mid-frame, after frames stored but not acknowledged, and while
        // frames are resent: each sample is still stored once.
        deliver_exactly_once(1 << 30, false, 24);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn workers_on_this_host_deliver_every_sample_and_group_through_shared_memory_once() {
        deliver_exactly_once(1 << 30, true, 0);
    }

    /// A TCP proxy to `port` on loopback that cuts up to `cuts` connections in all, each
    /// after a pseudo-random number of bytes from the worker (2,000 to 42,000: past the
    /// handshake), then forwards the rest whole. Returns its port and the cuts made so far.
    fn cutting_proxy(port: u16, cuts: usize) -> (u16, Arc<AtomicUsize>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let proxy = listener.local_addr().unwrap().port();
        let made = Arc::new(AtomicUsize::new(0));
        let counted = made.clone();
        thread::spawn(move || {
            let mut seed = 0x2545_f491_4f6c_dd1d_u64;
            for client in listener.incoming().take(10_000) {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(("127.0.0.1", port)) else { continue };
                seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                let limit = 2_000 + (seed >> 33) as usize % 40_000;
                let counted = counted.clone();
                let (mut c_in, mut s_out) =
                    (client.try_clone().unwrap(), server.try_clone().unwrap());
                let (mut s_in, mut c_out) = (server, client);
                thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    let mut passed = 0usize;
                    while let Ok(n) = c_in.read(&mut buf) {
                        let mut n = n;
                        let cut = passed + n >= limit
                            && counted
                                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| {
                                    (c < cuts).then_some(c + 1)
                                })
                                .is_ok();
                        if cut {
                            n = limit.saturating_sub(passed);
                            let _ = s_out.write_all(&buf[..n]);
                            break;
                        }
                        if n == 0 || s_out.write_all(&buf[..n]).is_err() {
                            break;
                        }
                        passed += n;
                    }
                    let _ = s_out.shutdown(std::net::Shutdown::Both);
                    let _ = c_in.shutdown(std::net::Shutdown::Both);
                });
                thread::spawn(move || {
                    let _ = std::io::copy(&mut s_in, &mut c_out);
                    let _ = c_out.shutdown(std::net::Shutdown::Both);
                });
            }
        });
        (proxy, made)
    }

    /// Four workers send 150 groups each (ids unique) while the learner reads; with `cuts`,
    /// through [`cutting_proxy`], reconnecting.
    fn deliver_exactly_once(budget: usize, shm: bool, cuts: usize) {
        let (table, tcp) = serve_with(16, Some(b"secret"), budget, shm);
        let (port, made) =
            if cuts > 0 { cutting_proxy(tcp.port(), cuts) } else { (tcp.port(), Arc::default()) };
        let workers: Vec<_> = (0..4u64)
            .map(|w| {
                thread::spawn(move || {
                    let options = SenderOptions {
                        token: Some(b"secret".to_vec()),
                        timeout: Duration::from_secs(5),
                        max_inflight: 64,
                        shared_memory: Some(shm),
                        reconnect: (cuts > 0).then_some(Duration::from_secs(20)),
                        ..SenderOptions::default()
                    };
                    let sender =
                        RaggedSender::connect("127.0.0.1", port, spec(), layout(), options)
                            .unwrap();
                    assert_eq!(sender.uses_shared_memory(), shm);
                    for g in 0..150u64 {
                        // Groups of 1 to 4 samples with ids w*100_000 + g*4 + k.
                        let size = (g % 4 + 1) as usize;
                        let first = w * 100_000 + g * 4;
                        send_group(&sender, first..first + size as u64).unwrap();
                    }
                    sender.flush(Some(Instant::now() + Duration::from_secs(30))).unwrap();
                    let (reconnects, _) = sender.recoveries();
                    let (sent, acked) = sender.counts();
                    (sent, acked, reconnects)
                })
            })
            .collect();
        let closer = {
            let table = table.clone();
            thread::spawn(move || {
                let counts: Vec<(u64, u64, u64)> =
                    workers.into_iter().map(|w| w.join().unwrap()).collect();
                table.close(true);
                counts
            })
        };
        let mut seen = HashSet::new();
        let deadline = Some(Instant::now() + Duration::from_secs(60));
        while let Some(batch) = table.sample(BatchLayout::Packed, deadline).unwrap() {
            let ids = check_packed(&batch);
            // Groups come whole: ids of one group share g, and their keys are equal.
            for (i, &id) in ids.iter().enumerate() {
                if i > 0 && batch.keys[i] == batch.keys[i - 1] {
                    assert_eq!(id, ids[i - 1] + 1, "a group's samples side by side, in order");
                }
                assert!(seen.insert(id), "sample {id} twice");
            }
        }
        let counts = closer.join().unwrap();
        let expected: u64 = 4 * (0..150u64).map(|g| g % 4 + 1).sum::<u64>();
        assert_eq!(seen.len() as u64, expected);
        assert!(counts.iter().all(|&(sent, acked, _)| sent == acked));
        let reconnects: u64 = counts.iter().map(|c| c.2).sum();
        let made = made.load(Ordering::SeqCst);
        assert!(made <= cuts && (cuts == 0 || made > 0), "{made} cuts");
        assert!(reconnects >= u64::from(made > 0), "{reconnects} reconnections, {made} cuts");
        let piped = tcp.counters().shm.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(piped, if shm { 4 } else { 0 });
        tcp.close(Closing::Final);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn frames_across_the_pipes_wrap_and_through_a_full_pipe_arrive_intact_and_once() {
        // ~10 MB through one 4 MiB pipe: frames straddle its wrap (copied into the table
        // from two places), and while the learner dawdles the pipe fills, so frames are
        // committed in parts (read into a buffer instead). Every sample's bytes are checked.
        let (table, tcp) = serve_with(16, None, 1 << 30, true);
        let sender = connect_with(tcp.port(), None, Some(true)).unwrap();
        assert!(sender.uses_shared_memory());
        let groups = 2_500u64;
        let writer = thread::spawn(move || {
            for g in 0..groups {
                send_group(&sender, g * 4..g * 4 + 4).unwrap();
            }
            sender.flush(Some(Instant::now() + Duration::from_secs(60))).unwrap();
        });
        let mut seen = HashSet::new();
        let deadline = Some(Instant::now() + Duration::from_secs(60));
        let mut batches = 0;
        while seen.len() < 4 * groups as usize {
            let batch = table.sample(BatchLayout::Packed, deadline).unwrap().unwrap();
            for id in check_packed(&batch) {
                assert!(seen.insert(id), "sample {id} twice");
            }
            batches += 1;
            if batches < 200 && batches % 10 == 0 {
                thread::sleep(Duration::from_millis(20)); // the pipe fills meanwhile
            }
        }
        writer.join().unwrap();
        assert_eq!(table.stats().inserted, 4 * groups);
        tcp.close(Closing::Final);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_hostile_frame_through_the_pipe_is_refused_before_its_body_and_stores_nothing() {
        let (table, tcp) = serve_with(4, None, 1 << 30, true);
        let sender = connect_with(tcp.port(), None, Some(true)).unwrap();
        assert!(sender.uses_shared_memory());
        // One sample claiming 4 billion rows in both ragged leaves.
        let mut frame = vec![0x18, 1, 0];
        frame.extend_from_slice(&u32::MAX.to_le_bytes());
        frame.extend_from_slice(&u32::MAX.to_le_bytes());
        sender.send_raw(&frame, None).unwrap();
        // A valid sample after it is never stored: the server ended the connection.
        let m = make(1, 3);
        let leaves: [&[u8]; 3] = [&m.tokens, &m.logp, &m.id];
        let sent =
            sender.send_group(&[Outgoing { rows: &[3, 3, 1], leaves: &leaves }], None, None, None);
        let err = sent
            .and_then(|()| sender.flush(Some(Instant::now() + Duration::from_secs(5))))
            .unwrap_err();
        assert!(err.to_string().contains("more than its max_len 300"), "{err}");
        assert_eq!(table.stats().samples, 0);
        tcp.close(Closing::Final);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn hostile_bytes_through_pipes_never_stall_the_pumps_or_store_anything() {
        // Sixty same-host workers each write a pseudo-random byte string into their pipe:
        // garbage, headers with random counts and lengths, half frames, heartbeats, whole
        // frames with wrong lengths. None of it is stored (nothing is a valid sample: every
        // frame claims rows past max_len, or is cut short), an honest worker's samples all go
        // in meanwhile and after, and the server closes without waiting on any of them.
        let (table, tcp) = serve_with(4, None, 1 << 30, true);
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut hostile = Vec::new();
        for case in 0..60u64 {
            let sender = connect_with(tcp.port(), None, Some(true)).unwrap();
            assert!(sender.uses_shared_memory());
            let mut bytes = Vec::new();
            match case % 4 {
                0 => bytes.extend((0..next() % 64).map(|_| next() as u8)),
                1 | 2 => {
                    for _ in 0..1 + next() % 3 {
                        bytes.push(if next() % 2 == 0 { 0x18 } else { 0x19 });
                        let n = (next() % 3) as u16; // 0 to 2 samples
                        bytes.extend_from_slice(&n.to_le_bytes());
                        if bytes[bytes.len() - 3] == 0x19 {
                            bytes.extend_from_slice(&1.0f64.to_le_bytes());
                        }
                        for _ in 0..2 * n {
                            // Past max_len 300: refused.
                            bytes.extend_from_slice(&(301 + next() as u32 % 1000).to_le_bytes());
                        }
                        bytes.extend((0..next() % 200).map(|_| next() as u8));
                        if next() % 3 == 0 {
                            bytes.push(v2::HEARTBEAT);
                        }
                    }
                }
                _ => {
                    // A valid header and a cut body: waits for a body that never comes.
                    bytes.extend_from_slice(&[0x18, 1, 0]);
                    bytes.extend_from_slice(&10u32.to_le_bytes());
                    bytes.extend_from_slice(&10u32.to_le_bytes());
                    bytes.extend((0..next() % 80).map(|_| next() as u8));
                }
            }
            if !bytes.is_empty() {
                let _ = sender.send_raw(&bytes, Some(Instant::now() + Duration::from_secs(5)));
            }
            hostile.push(sender);
        }
        let honest = connect_with(tcp.port(), None, Some(true)).unwrap();
        for g in 0..8u64 {
            send_group(&honest, g * 2..g * 2 + 2).unwrap();
        }
        honest.flush(Some(Instant::now() + Duration::from_secs(20))).unwrap();
        let deadline = Some(Instant::now() + Duration::from_secs(20));
        let mut seen = HashSet::new();
        while seen.len() < 16 {
            let batch = table.sample(BatchLayout::Packed, deadline).unwrap().unwrap();
            for id in check_packed(&batch) {
                assert!(seen.insert(id), "sample {id} twice");
            }
        }
        // The hostile workers leave; their connections end; nothing of theirs was stored.
        for sender in hostile.drain(..).rev() {
            sender.close();
        }
        thread::sleep(Duration::from_millis(300));
        assert_eq!(table.stats().inserted, 16);
        let started = Instant::now();
        tcp.close(Closing::Final);
        assert!(started.elapsed() < Duration::from_secs(5), "close took {:?}", started.elapsed());
    }

    /// CPU seconds of this process's threads named `name` so far (Linux's clock ticks).
    #[cfg(target_os = "linux")]
    fn threads_cpu(name: &str) -> f64 {
        let mut ticks = 0u64;
        for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            if comm.trim() != name {
                continue;
            }
            let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
            // After the command's closing parenthesis: fields 3 on; utime, stime are 14, 15.
            let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
            ticks += fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        }
        ticks as f64 / 100.0
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_worker_stopped_half_way_through_a_frame_holds_up_no_one_and_costs_nothing() {
        let (table, tcp) = serve_with(4, None, 1 << 30, true);
        let stuck = connect_with(tcp.port(), None, Some(true)).unwrap();
        assert!(stuck.uses_shared_memory());
        // One sample of 100 rows in both ragged leaves (808 body bytes), and half its body.
        let mut frame = vec![0x18, 1, 0];
        frame.extend_from_slice(&100u32.to_le_bytes());
        frame.extend_from_slice(&100u32.to_le_bytes());
        frame.extend_from_slice(&make(7, 100).tokens);
        stuck.send_raw(&frame, None).unwrap();
        // Another worker's samples go in meanwhile.
        let worker = connect_with(tcp.port(), None, Some(true)).unwrap();
        for id in 0..8u64 {
            let m = make(id, length_of(id));
            let leaves: [&[u8]; 3] = [&m.tokens, &m.logp, &m.id];
            let rows = [m.len, m.len, 1];
            worker
                .send_group(&[Outgoing { rows: &rows, leaves: &leaves }], None, None, None)
                .unwrap();
        }
        worker.flush(Some(Instant::now() + Duration::from_secs(10))).unwrap();
        let deadline = Some(Instant::now() + Duration::from_secs(10));
        let mut seen = HashSet::new();
        for _ in 0..2 {
            let batch = table.sample(BatchLayout::Packed, deadline).unwrap().unwrap();
            seen.extend(check_packed(&batch));
        }
        assert_eq!(seen, (0..8).collect::<HashSet<u64>>());
        // The half frame costs the threads that serve the pipes nothing while it waits.
        let before = threads_cpu("echo-ragged-pum") + threads_cpu("echo-ragged-conn");
        thread::sleep(Duration::from_millis(400));
        let spent = threads_cpu("echo-ragged-pum") + threads_cpu("echo-ragged-conn") - before;
        assert!(spent < 0.1, "{spent} s of CPU in 0.4 s waiting for half a frame");
        // Its worker gone, the half frame is dropped: nothing more is stored.
        stuck.close();
        drop(stuck);
        thread::sleep(Duration::from_millis(200));
        assert_eq!(table.stats().inserted, 8);
        tcp.close(Closing::Final);
    }

    #[test]
    fn a_snapshot_counts_each_workers_samples_and_a_restored_server_resumes_it_there() {
        let (_table, tcp) = serve(4, None);
        let sender = connect(tcp.port(), None).unwrap();
        for id in 0..10u64 {
            let m = make(id, length_of(id));
            let leaves: [&[u8]; 3] = [&m.tokens, &m.logp, &m.id];
            let rows = [m.len, m.len, 1];
            sender
                .send_group(&[Outgoing { rows: &rows, leaves: &leaves }], None, None, None)
                .unwrap();
        }
        sender.flush(Some(Instant::now() + Duration::from_secs(10))).unwrap();
        let (export, sessions) = tcp.snapshot().unwrap();
        assert_eq!(export.group_sizes.len(), 10);
        assert_eq!(sessions, vec![(sender.session(), 10)]);
        tcp.close(Closing::Restarting);
        // A server restored with the sessions: a worker that says it saw 8 acknowledged is
        // told that 10 are stored (it resends from there); one that saw 12 (a later
        // checkpoint's worth) resumes at 12; an unknown session at what it says.
        let options = TcpOptions {
            max_connections: 8,
            shared_memory: false,
            sessions: vec![(sender.session(), 10)],
            ..TcpOptions::default()
        };
        let table = Arc::new(RaggedTable::new(spec(), config(RaggedSampler::Fifo, 4, 16)).unwrap());
        let restored = RaggedTcp::start(table, layout(), "127.0.0.1", 0, options).unwrap();
        let resume = |session: [u8; 16], first_seq: u64| {
            let mut raw = TcpStream::connect(("127.0.0.1", restored.port())).unwrap();
            raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut offer = [0u8; v2::OFFER_LEN];
            raw.read_exact(&mut offer).unwrap();
            let offer = v2::Offer::parse(&offer).unwrap().unwrap();
            let hello = v2::Hello {
                session,
                first_seq,
                heartbeat_ms: 0,
                client_nonce: [0; 16],
                layout: layout(),
                mac: None,
                shm: false,
                notices: true,
                codecs: false,
                durable: false,
                params: false,
                versions: false,
            };
            raw.write_all(&hello.encode(&offer, None).unwrap()).unwrap();
            let mut reply = Vec::new();
            let mut chunk = [0u8; 512];
            loop {
                let n = raw.read(&mut chunk).unwrap();
                assert!(n > 0, "the server closed before its reply");
                reply.extend_from_slice(&chunk[..n]);
                if let Some((v2::Reply::Accepted(accept), _)) = v2::Reply::parse(&reply).unwrap() {
                    return accept.resume_seq;
                }
            }
        };
        assert_eq!(resume(sender.session(), 8), 10);
        assert_eq!(resume(sender.session(), 12), 12);
        assert_eq!(resume([7; 16], 3), 3);
        restored.close(Closing::Final);
    }

    #[test]
    fn shared_memory_required_from_a_server_without_it_is_an_error_naming_why() {
        let (_table, tcp) = serve_with(4, None, 1 << 30, false);
        let err = connect_with(tcp.port(), None, Some(true)).unwrap_err();
        assert!(matches!(err, EchoError::SharedMemory(_)), "{err}");
        assert!(err.to_string().contains("shared memory turned off"), "{err}");
        // The same server serves a worker that does not insist, over TCP.
        let sender = connect_with(tcp.port(), None, None).unwrap();
        assert!(!sender.uses_shared_memory());
        let m = make(1, 3);
        let leaves: [&[u8]; 3] = [&m.tokens, &m.logp, &m.id];
        sender
            .send_group(&[Outgoing { rows: &[3, 3, 1], leaves: &leaves }], None, None, None)
            .unwrap();
        sender.flush(Some(Instant::now() + Duration::from_secs(5))).unwrap();
        tcp.close(Closing::Final);
    }

    #[test]
    fn wrong_layouts_tokens_and_v1_clients_are_refused() {
        let (_table, tcp) = serve(4, Some(b"secret"));
        let err = connect(tcp.port(), Some(b"wrong")).unwrap_err();
        assert!(matches!(err, EchoError::Auth(_)), "{err}");
        let mut other = layout();
        other.0[1].shape = vec![7];
        let options = SenderOptions {
            token: Some(b"secret".to_vec()),
            max_inflight: 8,
            shared_memory: Some(false),
            ..SenderOptions::default()
        };
        let err =
            RaggedSender::connect("127.0.0.1", tcp.port(), spec(), other, options).unwrap_err();
        assert!(
            err.to_string().contains("['logp']") && err.to_string().contains("ragged leaves"),
            "{err}"
        );
        // A v1 client sends raw sample bytes after the greeting: no acknowledgement, closed.
        let mut raw = TcpStream::connect(("127.0.0.1", tcp.port())).unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut offer = [0u8; 38];
        raw.read_exact(&mut offer).unwrap();
        assert_eq!(&offer[..5], b"ECHO\x02");
        raw.write_all(&[7u8; 64]).unwrap();
        let mut rest = Vec::new();
        let _ = raw.read_to_end(&mut rest);
        assert!(!rest.contains(&1), "no acknowledgement for a v1 client");
        assert!(tcp.counters().refused.load(std::sync::atomic::Ordering::Relaxed) >= 3);
    }

    #[test]
    fn a_hostile_header_is_refused_before_its_body_is_read() {
        let (table, tcp) = serve(4, None);
        let sender = connect(tcp.port(), None).unwrap();
        // A valid sample first.
        let m = make(1, 3);
        let leaves: [&[u8]; 3] = [&m.tokens, &m.logp, &m.id];
        sender
            .send_group(&[Outgoing { rows: &[3, 3, 1], leaves: &leaves }], None, None, None)
            .unwrap();
        sender.flush(Some(Instant::now() + Duration::from_secs(5))).unwrap();
        // Then, by hand on a fresh connection: a frame claiming 4 billion rows.
        let raw = connect(tcp.port(), None).unwrap();
        let err = raw
            .send_group(
                &[Outgoing { rows: &[301, 301, 1], leaves: &[&[0; 1204], &[0; 1204], &[0; 8]] }],
                None,
                None,
                None,
            )
            .unwrap_err();
        assert!(matches!(err, EchoError::Sample(_)), "checked before sending: {err}");
        assert_eq!(table.stats().samples, 1);
        tcp.close(Closing::Final);
        let err =
            sender.send_group(&[Outgoing { rows: &[3, 3, 1], leaves: &leaves }], None, None, None);
        let err = err.and_then(|()| sender.flush(Some(Instant::now() + Duration::from_secs(5))));
        assert!(err.is_err(), "the server closed");
    }
}

#[test]
fn stale_entries_are_dropped_at_insert_and_removed_when_drawn_or_handed_out() {
    // The spec's last leaf is each sample's policy version; a bound of 1 version.
    let versioned = spec().with_version_leaf();
    for sampler in [RaggedSampler::Fifo, RaggedSampler::Uniform] {
        let mut cfg = config(sampler.clone(), 4, 64);
        cfg.versions = Some(VersionsConfig { max_staleness: Some(1), admission: Admission::Drop });
        let table = RaggedTable::new(versioned.clone(), cfg).unwrap();
        let versions = table.versions().unwrap().clone();
        versions.set_latest(5);
        let insert = |id: u64, version: u64| {
            let made = make(id, 3);
            let stamp = version.to_le_bytes();
            let mut sample = made.sample();
            sample.leaves.push(&stamp);
            sample.rows.push(1);
            table.insert_group(&[sample], None, None).unwrap()
        };
        assert_eq!(insert(0, 3), DROPPED, "more than 1 behind 5: dropped at insert");
        for id in 1..=8 {
            assert_ne!(insert(id, 4 + id % 2), DROPPED); // odd ids: 5, even ids: 4
        }
        versions.set_latest(6); // floor 5: the even ids are stale now
        let mut seen = HashSet::new();
        for _ in 0..if sampler == RaggedSampler::Fifo { 1 } else { 20 } {
            let batch = table.sample(BatchLayout::Packed, Some(Instant::now())).unwrap().unwrap();
            let stamps = batch.column_bytes(3);
            assert!(stamps.chunks_exact(8).all(|v| u64::from_le_bytes(v.try_into().unwrap()) == 5));
            seen.extend(ids(&batch));
        }
        assert_eq!(seen, HashSet::from([1, 3, 5, 7]), "{sampler:?}");
        let counts = versions.counts();
        assert_eq!((counts.at_insert, counts.at_sample), (1, 4), "{sampler:?}");
    }
}
