//! Fetching the learner's parameters ([`crate::transport::wire::params`]): the latest version
//! the server announced, and a whole version pulled chunk by chunk into the caller's buffer,
//! started over when two publishes overtake it.

use std::io::Write;
use std::sync::atomic::Ordering::Acquire;
use std::time::Instant;

use super::link::Link;
use super::recovery::wait_on;
use super::TcpSender;
use crate::error::EchoError;
use crate::transport::wire::params::{Chunk, Fetch, DESCRIPTION, MAX_CHUNK};

/// Parameter chunks a fetch keeps requested ahead of the one it waits for.
const FETCH_WINDOW: usize = 4;

/// How far a fetch of one version got: the bytes filled (in order), the offset requested
/// next, and the requests in flight (id and what each asked), oldest first.
#[derive(Debug, Default)]
pub(super) struct Fetching {
    version: u64,
    filled: usize,
    asked: usize,
    inflight: std::collections::VecDeque<(u64, Fetch)>,
}

impl TcpSender {
    /// Fetches of a whole version that completed, and the seconds they took in all (from
    /// the first call to the last of a fetch cut into slices).
    pub fn params_fetches(&self) -> (u64, f64) {
        self.fetches
    }

    /// The latest version of the learner's parameters the server announced: 0 before the
    /// first publish (and from a server that serves none).
    pub fn params_version(&self) -> u64 {
        let latest = self.link.as_ref().map_or(0, |link| {
            // ORDERING: Acquire pairs with the reader's Release `fetch_max`.
            link.acks.params_version.load(Acquire)
        });
        latest.max(self.params_floor)
    }

    /// Fetches a whole version of the learner's parameters, at least `min_version` (at
    /// least 1: something published), into `out` (exactly the parameters' size), waiting
    /// until `deadline` for it to be published. Returns its version; `out` holds it whole,
    /// every byte of that one version. With reconnection a dropped connection is reconnected
    /// and the fetch started over. After [`EchoError::TimedOut`], a call with `resume` and
    /// the same `out` goes on where the last one stopped (a deadline cut into slices loses
    /// no chunk); without `resume` a fetch starts afresh.
    ///
    /// # Errors
    /// [`EchoError::TimedOut`] at `deadline` (`out` may hold part of a version then);
    /// [`EchoError::Protocol`] when the server serves no parameters, or publishes them of
    /// another size; as [`TcpSender::send`] for a connection that is gone.
    pub fn fetch_params(
        &mut self,
        out: &mut [u8],
        min_version: u64,
        deadline: Option<Instant>,
        resume: bool,
    ) -> Result<u64, EchoError> {
        if !resume {
            self.fetching = None;
            self.fetch_started = Some(Instant::now());
        }
        loop {
            self.ensure_usable()?;
            if self.reconnect {
                // Reconnects if need be and finishes a sample accepted but not yet written:
                // a fetch goes between frames.
                self.drive(deadline)?;
            } else if self.in_progress > 0 {
                return Err(EchoError::Protocol(
                    "a sample is partly sent (a send timed out mid-write): send it again to \
                     finish it before fetching parameters"
                        .into(),
                ));
            }
            match self.fetch_once(out, min_version.max(1), deadline) {
                Err(EchoError::Disconnected(_)) if self.reconnect => self.fetching = None,
                Err(EchoError::TimedOut) => return Err(EchoError::TimedOut),
                other => {
                    self.fetching = None;
                    return other;
                }
            }
        }
    }

    /// One try of [`TcpSender::fetch_params`] on the current connection.
    fn fetch_once(
        &mut self,
        out: &mut [u8],
        min_version: u64,
        deadline: Option<Instant>,
    ) -> Result<u64, EchoError> {
        self.serving_link()?;
        #[cfg(target_os = "linux")]
        if let Some(version) = self.fetch_shared(out, min_version, deadline)? {
            self.fetched(version);
            return Ok(version);
        }
        self.serving_link()?;
        // The field itself (not through `&self`): the loop below takes `self.fetching` too.
        let link = self.link.as_ref().expect("checked by serving_link");
        let size = out.len() as u64;
        // This connection's server (a restarted one announces its latest at once).
        let announced = || {
            // ORDERING: Acquire, as in `params_version`.
            link.acks.params_version.load(Acquire)
        };
        loop {
            // Where a fetch that timed out stopped (the same buffer), with the requests it
            // left in flight, or the start.
            let mut at = self.fetching.take().unwrap_or_default();
            if at.version == 0 {
                wait_on(&link.acks, || announced() >= min_version, deadline)?;
                // A probe first: parameters of another size are this client's mistake (its
                // layout), not the connection's.
                let probe = Fetch { version: 0, offset: 0, len: 0 };
                let id = send_fetch(link, probe, size)?;
                let (latest, _) = await_answer(link, id, deadline)?;
                if latest.version != 0 && latest.size != size {
                    return Err(EchoError::Protocol(format!(
                        "the learner at {} publishes parameters of {} bytes, this client's \
                         layout has {size}",
                        self.address, latest.size
                    )));
                }
                // That version from here on (a fetch cut short goes on with it).
                at = Fetching { version: latest.version, ..Fetching::default() };
            }
            while at.filled < out.len() {
                // Up to `FETCH_WINDOW` requests in flight: the server answers one while the
                // next is on its way, instead of a round trip per chunk.
                while at.inflight.len() < FETCH_WINDOW && at.asked < out.len() {
                    let len = (out.len() - at.asked).min(MAX_CHUNK as usize);
                    let asked =
                        Fetch { version: at.version, offset: at.asked as u64, len: len as u32 };
                    at.inflight.push_back((send_fetch(link, asked, size)?, asked));
                    at.asked += len;
                }
                let (id, asked) = *at.inflight.front().expect("a request in flight");
                // The answer to a request a timed-out call left in flight (a chunk slower
                // than a caller's slice still arrives), or a new one's.
                let (chunk, bytes) = match await_answer(link, id, deadline) {
                    Ok(answer) => answer,
                    Err(err) => {
                        if matches!(err, EchoError::TimedOut) {
                            self.fetching = Some(at);
                        }
                        return Err(err);
                    }
                };
                at.inflight.pop_front();
                if chunk.version == 0 {
                    // Nothing published (a notice from before a restart cannot be: this
                    // connection's server announced it): cannot happen twice in a row.
                    return Err(EchoError::Protocol(format!(
                        "the server at {} announced version {} of its parameters but has none",
                        self.address,
                        announced()
                    )));
                }
                if chunk.superseded(&asked) {
                    // The requests still in flight ask for the old version: given up, their
                    // answers are dropped as later ones are awaited.
                    at = Fetching { version: chunk.version, ..Fetching::default() };
                    continue;
                }
                let (offset, len) = (asked.offset as usize, asked.len as usize);
                let into = &mut out[offset..offset + len];
                match chunk.packed {
                    None => into.copy_from_slice(&bytes),
                    Some((codec, _)) => codec.decompress_into(&bytes, into).map_err(|e| {
                        EchoError::Protocol(format!(
                            "a compressed parameter chunk (bytes {offset}..+{len} of version \
                             {}) does not decompress: {e}",
                            chunk.version
                        ))
                    })?,
                }
                at.filled = offset + len;
                link.acks.fetch.lock().recycle(bytes);
            }
            let version = at.version;
            let offset = at.filled;
            if offset == out.len() && version >= min_version {
                self.fetched(version);
                return Ok(version);
            }
        }
    }
}

impl TcpSender {
    /// The description of the learner's parameters ([`DESCRIPTION`]): the bytes its Python
    /// layer gave with the first publish, waiting until `deadline` for something to be
    /// published. Empty when the learner gave none.
    ///
    /// # Errors
    /// [`EchoError::TimedOut`] at `deadline`; [`EchoError::Protocol`] when the server serves
    /// no parameters; as [`TcpSender::send`] for a connection that is gone.
    pub fn fetch_params_description(
        &mut self,
        deadline: Option<Instant>,
    ) -> Result<Vec<u8>, EchoError> {
        self.ensure_usable()?;
        if self.in_progress > 0 {
            return Err(EchoError::Protocol(
                "a sample is partly sent: send it again before fetching parameters".into(),
            ));
        }
        let link = self.serving_link()?;
        // ORDERING: Acquire, as in `params_version`.
        wait_on(&link.acks, || link.acks.params_version.load(Acquire) > 0, deadline)?;
        let probe = Fetch { version: DESCRIPTION, offset: 0, len: 0 };
        let id = send_fetch(link, probe, 0)?;
        let (head, _) = await_answer(link, id, deadline)?;
        if head.version != DESCRIPTION {
            return Err(EchoError::Protocol(format!(
                "the learner at {} does not describe its parameters (an echo learner older \
                 than this client)",
                self.address
            )));
        }
        let size = usize::try_from(head.size).map_err(|_| {
            EchoError::Protocol(format!("a parameter description of {} bytes", head.size))
        })?;
        let mut out = Vec::new();
        while out.len() < size {
            let len = (size - out.len()).min(MAX_CHUNK as usize);
            let asked = Fetch { version: DESCRIPTION, offset: out.len() as u64, len: len as u32 };
            let id = send_fetch(link, asked, head.size)?;
            let (chunk, bytes) = await_answer(link, id, deadline)?;
            if chunk.size != head.size || bytes.len() != len {
                return Err(EchoError::Protocol(
                    "the parameters' description changed while it was fetched".into(),
                ));
            }
            out.extend_from_slice(&bytes);
            link.acks.fetch.lock().recycle(bytes);
        }
        Ok(out)
    }
}

impl TcpSender {
    /// The current connection, which must serve parameters.
    ///
    /// # Errors
    /// [`EchoError::Disconnected`] without one; [`EchoError::Protocol`] when its server
    /// serves no parameters.
    fn serving_link(&self) -> Result<&Link, EchoError> {
        let Some(link) = &self.link else {
            return Err(EchoError::Disconnected(self.failure()));
        };
        if !link.params {
            return Err(EchoError::Protocol(format!(
                "the server at {} serves no parameters (wire protocol 1, or an echo learner \
                 older than this client)",
                self.address
            )));
        }
        Ok(link)
    }

    /// A whole version was fetched: the policy this worker acts with from now on (what its
    /// samples carry), and the fetch counted.
    fn fetched(&mut self, version: u64) {
        self.policy_version = self.policy_version.max(version);
        self.newest_version = self.newest_version.max(version);
        if let Some(started) = self.fetch_started.take() {
            self.fetches.0 += 1;
            self.fetches.1 += started.elapsed().as_secs_f64();
        }
    }

    /// [`TcpSender::fetch_params`] from the learner's shared-memory region, when it handed
    /// it over with the connection's shared-memory channel: one copy straight into `out`,
    /// no chunk through the socket. `None` when there is no region (fetch over the socket).
    #[cfg(target_os = "linux")]
    fn fetch_shared(
        &mut self,
        out: &mut [u8],
        min_version: u64,
        deadline: Option<Instant>,
    ) -> Result<Option<u64>, EchoError> {
        use crate::transport::shm::params::ViewRead;
        let address = self.address.clone();
        let Some(link) = self.link.as_mut() else { return Ok(None) };
        if link.shm.as_mut().and_then(|writer| writer.params()).is_none() {
            return Ok(None);
        }
        let acks = std::sync::Arc::clone(&link.acks);
        // ORDERING: Acquire, as in `params_version`.
        let announced = || acks.params_version.load(Acquire);
        loop {
            wait_on(&acks, || announced() >= min_version, deadline)?;
            let view = link.shm.as_mut().and_then(|writer| writer.params()).expect("checked");
            match view.read(out, 64).map_err(EchoError::Protocol)? {
                ViewRead::Copied(version) if version >= min_version => return Ok(Some(version)),
                ViewRead::Size(size) => {
                    return Err(EchoError::Protocol(format!(
                        "the learner at {address} publishes parameters of {size} bytes, this \
                         client's layout has {}",
                        out.len()
                    )))
                }
                // Announced but not in the region (a learner whose region could not hold
                // them): over the socket.
                ViewRead::Empty => return Ok(None),
                // Publishes overlapped every copy, or an older version: again, shortly.
                ViewRead::Copied(_) | ViewRead::Busy => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(EchoError::TimedOut);
                    }
                    std::thread::sleep(std::time::Duration::from_micros(100));
                }
            }
        }
    }
}

/// Sends one FETCH on `link`; the id its answer will carry (see [`await_answer`]).
fn send_fetch(link: &Link, asked: Fetch, size: u64) -> Result<u64, EchoError> {
    let id = {
        let mut slot = link.acks.fetch.lock();
        let id = slot.next_id;
        slot.next_id += 1;
        slot.asked.push_back((id, asked, size));
        id
    };
    {
        // Between frames (the caller made sure), and never inside a heartbeat.
        let mut writing = link.writing.lock();
        if let Err(e) = (&link.stream).write_all(&asked.encode()) {
            let reason = format!("sending a parameter fetch failed: {e}");
            link.acks.lose(reason.clone());
            return Err(EchoError::Disconnected(reason));
        }
        writing.last_write = Instant::now();
    }
    Ok(id)
}

/// Waits (until `deadline`) for the answer to the fetch `id`: its chunk and bytes. Answers to
/// earlier fetches, given up, are dropped.
fn await_answer(
    link: &Link,
    id: u64,
    deadline: Option<Instant>,
) -> Result<(Chunk, Vec<u8>), EchoError> {
    let answered = || {
        let mut slot = link.acks.fetch.lock();
        while slot.answers.front().is_some_and(|a| a.0 < id) {
            if let Some((_, _, bytes)) = slot.answers.pop_front() {
                slot.recycle(bytes);
            }
        }
        slot.answers.front().is_some_and(|a| a.0 == id)
    };
    wait_on(&link.acks, answered, deadline)?;
    let (_, chunk, bytes) = link.acks.fetch.lock().answers.pop_front().expect("answered");
    Ok((chunk, bytes))
}
