//! A worker's connection to a ragged server: wire v2's handshake, then one group frame per
//! `send_group` ([`super::wire`]). Samples are checked against the spec before they are
//! sent (lengths, length groups, the server's largest group), so a bad sample raises at
//! the caller and nothing of it goes out. A reader thread counts the acknowledgements and
//! keeps the server's error or closing notice for the next call.

use std::io::{IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::spec::RaggedSpec;
use super::wire::{encode_head, Outgoing};
use crate::error::EchoError;
use crate::transport::wire::v2::{self, Closing, Hello, Layout, Offer, Reply};

#[derive(Debug, Default)]
struct State {
    sent: u64,
    acked: u64,
    error: Option<String>,
    closing: Option<Closing>,
    ended: bool,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    /// Waits for a change, or fails once `deadline` has passed.
    fn wait(
        &self,
        state: &mut parking_lot::MutexGuard<'_, State>,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        match deadline {
            Some(d) if Instant::now() >= d => return Err(EchoError::TimedOut),
            Some(d) => {
                let _ = self.changed.wait_until(state, d);
            }
            None => self.changed.wait(state),
        }
        Ok(())
    }
}

/// The sending side of a worker.
#[derive(Debug)]
pub struct RaggedSender {
    spec: RaggedSpec,
    stream: Mutex<TcpStream>,
    shared: Arc<Shared>,
    reader: Mutex<Option<JoinHandle<()>>>,
    max_group: usize,
    max_inflight: u64,
}

fn read_some(stream: &mut TcpStream, received: &mut Vec<u8>) -> Result<(), EchoError> {
    let mut chunk = [0u8; 4096];
    let n = stream.read(&mut chunk)?;
    if n == 0 {
        return Err(EchoError::Disconnected("the server closed during the handshake".into()));
    }
    received.extend_from_slice(&chunk[..n]);
    Ok(())
}

impl RaggedSender {
    /// Connects to `host:port` and completes the handshake for samples of `spec`, described
    /// as `layout`, proving `token` if given. At most `max_inflight` samples wait for their
    /// acknowledgement at once.
    ///
    /// # Errors
    /// [`EchoError::Io`] / [`EchoError::Disconnected`] if the server cannot be reached;
    /// [`EchoError::Protocol`] if it refuses the layout (naming the leaf) or is not a ragged
    /// server; [`EchoError::Auth`] for a wrong or missing token.
    pub fn connect(
        host: &str,
        port: u16,
        spec: RaggedSpec,
        layout: Layout,
        token: Option<&[u8]>,
        timeout: Duration,
        max_inflight: usize,
    ) -> Result<Self, EchoError> {
        let addr = (host, port)
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| EchoError::Config(format!("cannot resolve {host}:{port}")))?;
        let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        let mut received = Vec::new();
        // An open fixed-shape server greets v1 clients first: skip its v1 handshake.
        while received.len() < 5 {
            read_some(&mut stream, &mut received)?;
        }
        if received[4] == crate::transport::wire::VERSION {
            loop {
                if let Some((_, used)) = crate::transport::wire::parse_handshake(&received)? {
                    received.drain(..used);
                    break;
                }
                read_some(&mut stream, &mut received)?;
            }
        }
        let offer = loop {
            if let Some(offer) = Offer::parse(&received)? {
                received.drain(..v2::OFFER_LEN);
                break offer;
            }
            read_some(&mut stream, &mut received)?;
        };
        let hello = Hello {
            session: v2::random()?,
            first_seq: 0,
            heartbeat_ms: 0,
            client_nonce: v2::random()?,
            layout,
            mac: None,
            shm: false,
            notices: true,
            codecs: false,
            durable: false,
            params: false,
            versions: false,
        };
        stream.write_all(&hello.encode(&offer, token)?)?;
        let reply = loop {
            if let Some((reply, used)) = Reply::parse(&received)? {
                received.drain(..used);
                break reply;
            }
            read_some(&mut stream, &mut received)?;
        };
        let accept = match reply {
            Reply::Accepted(accept) => accept,
            Reply::Refused(why, message) => return Err(why.into_error(message)),
        };
        if let Some(token) = token {
            if !accept.verify(token, &hello, &offer) {
                return Err(EchoError::Auth("the server did not prove the token".into()));
            }
        }
        let max_group = accept.steps.ok_or_else(|| {
            EchoError::Protocol(
                "the server accepted the layout but is not a ragged server (no group size)".into(),
            )
        })? as usize;
        stream.set_read_timeout(None)?;
        let shared = Arc::new(Shared::default());
        let mut reading = stream.try_clone()?;
        let counting = shared.clone();
        let reader = std::thread::Builder::new()
            .name("echo-ragged-acks".into())
            .spawn(move || read_acks(&mut reading, received, &counting))?;
        Ok(Self {
            spec,
            stream: Mutex::new(stream),
            shared,
            reader: Mutex::new(Some(reader)),
            max_group,
            max_inflight: max_inflight.max(1) as u64,
        })
    }

    /// The spec samples are checked against.
    pub fn spec(&self) -> &RaggedSpec {
        &self.spec
    }

    /// (sent, acknowledged) samples.
    pub fn counts(&self) -> (u64, u64) {
        let state = self.shared.state.lock();
        (state.sent, state.acked)
    }

    fn failure(state: &State) -> Option<EchoError> {
        if let Some(why) = &state.error {
            return Some(EchoError::Protocol(format!("the server refused a sample: {why}")));
        }
        match state.closing {
            Some(Closing::Final) => Some(EchoError::ServerClosed("the server closed".into())),
            Some(Closing::Restarting) => {
                Some(EchoError::Disconnected("the server is restarting".into()))
            }
            None if state.ended => {
                Some(EchoError::Disconnected("the server closed the connection".into()))
            }
            None => None,
        }
    }

    /// Sends `samples` as one group frame (a single sample when there is one), waiting until
    /// `deadline` while `max_inflight` samples are unacknowledged.
    ///
    /// # Errors
    /// [`EchoError::Sample`] for a sample the server would refuse (nothing is sent);
    /// [`EchoError::TimedOut`]; the server's error, closing or disconnection.
    pub fn send_group(
        &self,
        samples: &[Outgoing<'_>],
        priority: Option<f64>,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        if samples.len() > self.max_group {
            return Err(EchoError::Sample(format!(
                "a group of {} samples is larger than a batch (batch_size {})",
                samples.len(),
                self.max_group
            )));
        }
        if let Some(p) = priority.filter(|p| !p.is_finite() || *p < 0.0) {
            return Err(EchoError::Priority(format!(
                "a priority must be finite and >= 0, got {p}"
            )));
        }
        for sample in samples {
            let bytes: Vec<usize> = sample.leaves.iter().map(|l| l.len()).collect();
            let rows: Vec<usize> = self
                .spec
                .columns()
                .iter()
                .zip(sample.rows)
                .map(|(c, &r)| if c.is_ragged() { r } else { 1 })
                .collect();
            self.spec.check(&rows, &bytes)?;
        }
        let head = encode_head(&self.spec, samples, priority)?;
        {
            let mut state = self.shared.state.lock();
            loop {
                if let Some(err) = Self::failure(&state) {
                    return Err(err);
                }
                if state.sent - state.acked < self.max_inflight {
                    break;
                }
                self.shared.wait(&mut state, deadline)?;
            }
        }
        // One vectored write: the header, then every leaf straight from the caller's arrays.
        let mut parts: Vec<IoSlice<'_>> = Vec::with_capacity(1 + samples.len() * 4);
        parts.push(IoSlice::new(&head));
        parts.extend(
            samples
                .iter()
                .flat_map(|s| s.leaves.iter().filter(|l| !l.is_empty()).map(|l| IoSlice::new(l))),
        );
        let mut stream = self.stream.lock();
        let mut rest = &mut parts[..];
        while !rest.is_empty() {
            let written = stream.write_vectored(rest)?;
            if written == 0 {
                return Err(EchoError::Disconnected("the server stopped reading".into()));
            }
            IoSlice::advance_slices(&mut rest, written);
        }
        drop(stream);
        self.shared.state.lock().sent += samples.len() as u64;
        Ok(())
    }

    /// Waits until every sample sent is acknowledged (stored by the server).
    ///
    /// # Errors
    /// [`EchoError::TimedOut`]; the server's error, closing or disconnection while samples
    /// are unacknowledged.
    pub fn flush(&self, deadline: Option<Instant>) -> Result<(), EchoError> {
        let mut state = self.shared.state.lock();
        loop {
            if state.acked >= state.sent {
                return Ok(());
            }
            if let Some(err) = Self::failure(&state) {
                return Err(err);
            }
            self.shared.wait(&mut state, deadline)?;
        }
    }

    /// Says goodbye and closes the connection (without waiting for acknowledgements: call
    /// [`RaggedSender::flush`] first for that).
    pub fn close(&self) {
        {
            let mut stream = self.stream.lock();
            let _ = stream.write_all(&[v2::BYE]);
            let _ = stream.shutdown(Shutdown::Both);
        }
        if let Some(reader) = self.reader.lock().take() {
            let _ = reader.join();
        }
    }
}

impl Drop for RaggedSender {
    fn drop(&mut self) {
        self.close();
    }
}

/// The reader thread: acknowledgements, heartbeats, an error or a closing notice.
fn read_acks(stream: &mut TcpStream, mut pending: Vec<u8>, shared: &Shared) {
    let mut chunk = [0u8; 4096];
    loop {
        let mut at = 0;
        let mut acks = 0u64;
        let mut stop = None;
        while at < pending.len() {
            match pending[at] {
                v2::ACK => {
                    acks += 1;
                    at += 1;
                }
                v2::BEAT => at += 1,
                v2::CLOSING => match pending.get(at + 1) {
                    Some(&why) => {
                        stop = Some(Err(Closing::from_byte(why).unwrap_or(Closing::Final)));
                        break;
                    }
                    None => break,
                },
                v2::ERROR => match v2::parse_error(&pending[at + 1..]) {
                    Ok(Some((message, _))) => {
                        stop = Some(Ok(message));
                        break;
                    }
                    Ok(None) => break,
                    Err(err) => {
                        stop = Some(Ok(err.to_string()));
                        break;
                    }
                },
                other => {
                    stop = Some(Ok(format!("an unknown byte {other:#04x} from the server")));
                    break;
                }
            }
        }
        pending.drain(..at);
        {
            let mut state = shared.state.lock();
            state.acked += acks;
            match stop.take() {
                Some(Ok(message)) => state.error = Some(message),
                Some(Err(closing)) => state.closing = Some(closing),
                None => {}
            }
        }
        shared.changed.notify_all();
        let done = {
            let state = shared.state.lock();
            state.error.is_some() || state.closing.is_some()
        };
        if done {
            break;
        }
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => pending.extend_from_slice(&chunk[..n]),
        }
    }
    shared.state.lock().ended = true;
    shared.changed.notify_all();
}
