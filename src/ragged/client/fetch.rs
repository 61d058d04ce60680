//! A ragged worker's parameter fetches ([`crate::transport::wire::params`]): the latest
//! version the learner announced, copied from the learner's parameter region when the worker
//! is on its host (handed over with its pipe), else pulled chunk by chunk (a few requests in
//! flight) through the connection's frames (the answers come on the socket), and started
//! over when two publishes overtake it; and the parameters' description.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::pipe::{Region, ViewRead};
use super::{failure, RaggedSender, View};
use crate::error::EchoError;
use crate::transport::wire::params::{Chunk, Fetch, DESCRIPTION, MAX_CHUNK};

/// Chunk requests a fetch keeps in flight.
const WINDOW: usize = 4;
/// Copies of the region one read tries while publishes overlap them.
const REGION_TRIES: usize = 16;
/// Reads of the region a fetch makes while it holds an older version than announced
/// (a millisecond apart), before it fetches in chunks instead.
const REGION_WAITS: usize = 200;

impl RaggedSender {
    /// Whole versions fetched, and the seconds the fetches took in all.
    pub fn params_fetches(&self) -> (u64, f64) {
        *self.fetches.lock()
    }

    /// Fetches a whole version of the learner's parameters, at least `min_version` (at
    /// least 1: something published), into `out` (exactly the parameters' size), waiting
    /// until `deadline` for it to be announced. Returns its version; `out` holds it whole,
    /// every byte of that one version. The version becomes the worker's `policy_version`.
    /// A connection lost meanwhile is reconnected (with `reconnect`) and the fetch started
    /// over.
    ///
    /// # Errors
    /// [`EchoError::TimedOut`] at `deadline`; [`EchoError::Protocol`] when the learner
    /// publishes parameters of another size; as [`RaggedSender::flush`] for a connection
    /// that is gone.
    pub fn fetch_params(
        &self,
        out: &mut [u8],
        min_version: u64,
        deadline: Option<Instant>,
    ) -> Result<u64, EchoError> {
        let started = Instant::now();
        loop {
            let view = self.view.lock().clone();
            match self.fetch_on(&view, out, min_version.max(1), deadline) {
                Ok(version) => {
                    // ORDERING: Relaxed — a setting read on its own (as `set_policy_version`):
                    // the samples sent from now on carry the version fetched.
                    self.policy_version.fetch_max(version, std::sync::atomic::Ordering::Relaxed);
                    let mut fetches = self.fetches.lock();
                    fetches.0 += 1;
                    fetches.1 += started.elapsed().as_secs_f64();
                    return Ok(version);
                }
                Err(err @ (EchoError::Disconnected(_) | EchoError::Io(_))) => {
                    self.recover_from(&view, err, deadline)?;
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// One try of [`RaggedSender::fetch_params`] on `view`'s connection.
    fn fetch_on(
        &self,
        view: &View,
        out: &mut [u8],
        min_version: u64,
        deadline: Option<Instant>,
    ) -> Result<u64, EchoError> {
        let size = out.len() as u64;
        loop {
            self.wait_announced(view, min_version, deadline)?;
            if let Some(region) = &view.region {
                if let Some(version) = Self::from_region(region, out, min_version, deadline)? {
                    return Ok(version);
                }
            }
            // A probe first: parameters of another size are this worker's mistake (its
            // layout), not the connection's.
            let probe = Fetch { version: 0, offset: 0, len: 0 };
            let id = self.ask(view, probe, size, deadline)?;
            let (latest, _) = self.answer(view, id, deadline)?;
            if latest.version == 0 {
                // Announced before its bytes were there: shortly again.
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(EchoError::TimedOut);
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
                continue;
            }
            if latest.size != size {
                return Err(EchoError::Protocol(format!(
                    "the learner publishes parameters of {} bytes, this worker's layout has \
                     {size}",
                    latest.size
                )));
            }
            let mut version = latest.version;
            let (mut filled, mut asked_up_to) = (0usize, 0usize);
            let mut inflight = std::collections::VecDeque::new();
            while filled < out.len() {
                while inflight.len() < WINDOW && asked_up_to < out.len() {
                    let len = (out.len() - asked_up_to).min(MAX_CHUNK as usize);
                    let asked = Fetch { version, offset: asked_up_to as u64, len: len as u32 };
                    inflight.push_back((self.ask(view, asked, size, deadline)?, asked));
                    asked_up_to += len;
                }
                let (id, asked) = inflight.pop_front().expect("a request in flight");
                let (chunk, bytes) = self.answer(view, id, deadline)?;
                if chunk.superseded(&asked) {
                    // Two publishes overtook it: the latest from the start (the answers to
                    // the requests still in flight are dropped as later ones are awaited).
                    version = chunk.version;
                    (filled, asked_up_to) = (0, 0);
                    inflight.clear();
                    continue;
                }
                let (offset, len) = (asked.offset as usize, asked.len as usize);
                let into = &mut out[offset..offset + len];
                match chunk.packed {
                    None => into.copy_from_slice(&bytes),
                    Some((codec, _)) => codec.decompress_into(&bytes, into).map_err(|e| {
                        EchoError::Protocol(format!(
                            "a compressed parameter chunk (bytes {offset}..+{len} of version \
                             {version}) does not decompress: {e}"
                        ))
                    })?,
                }
                filled = offset + len;
            }
            if version >= min_version {
                return Ok(version);
            }
        }
    }

    /// A version of at least `min_version` copied from the learner's parameter `region` into
    /// `out`; `None` when the region gives none now (publishes overlapping every copy, a
    /// region that cannot be mapped, an older version than announced for a while): the
    /// caller fetches it in chunks instead.
    ///
    /// # Errors
    /// [`EchoError::Protocol`] when the learner publishes parameters of another size;
    /// [`EchoError::TimedOut`] at `deadline`.
    fn from_region(
        region: &Mutex<Region>,
        out: &mut [u8],
        min_version: u64,
        deadline: Option<Instant>,
    ) -> Result<Option<u64>, EchoError> {
        for _ in 0..REGION_WAITS {
            let read = region.lock().read(out, REGION_TRIES);
            match read {
                Ok(ViewRead::Copied(version)) if version >= min_version => {
                    return Ok(Some(version))
                }
                Ok(ViewRead::Size(size)) => {
                    return Err(EchoError::Protocol(format!(
                        "the learner publishes parameters of {size} bytes, this worker's \
                         layout has {}",
                        out.len()
                    )))
                }
                // Announced before the region holds it (a version published without
                // parameters, a restored one): shortly again.
                Ok(ViewRead::Copied(_) | ViewRead::Empty) => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(EchoError::TimedOut);
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Ok(ViewRead::Busy) => return Ok(None),
                Err(why) => {
                    log::debug!("the parameter region: {why}; fetching in chunks");
                    return Ok(None);
                }
            }
        }
        Ok(None)
    }

    /// The parameters' description (the bytes the learner's Python layer gave with its
    /// first publish), waiting until `deadline` for something to be published; empty when
    /// it gave none.
    ///
    /// # Errors
    /// As [`RaggedSender::fetch_params`].
    pub fn fetch_description(&self, deadline: Option<Instant>) -> Result<Vec<u8>, EchoError> {
        loop {
            let view = self.view.lock().clone();
            match self.description_on(&view, deadline) {
                Err(err @ (EchoError::Disconnected(_) | EchoError::Io(_))) => {
                    self.recover_from(&view, err, deadline)?;
                }
                other => return other,
            }
        }
    }

    fn description_on(&self, view: &View, deadline: Option<Instant>) -> Result<Vec<u8>, EchoError> {
        self.wait_announced(view, 1, deadline)?;
        let probe = Fetch { version: DESCRIPTION, offset: 0, len: 0 };
        let id = self.ask(view, probe, 0, deadline)?;
        let (head, _) = self.answer(view, id, deadline)?;
        let size = usize::try_from(head.size).map_err(|_| {
            EchoError::Protocol(format!("a parameter description of {} bytes", head.size))
        })?;
        let mut out = Vec::with_capacity(size);
        while out.len() < size {
            let len = (size - out.len()).min(MAX_CHUNK as usize);
            let asked = Fetch { version: DESCRIPTION, offset: out.len() as u64, len: len as u32 };
            let id = self.ask(view, asked, head.size, deadline)?;
            let (chunk, bytes) = self.answer(view, id, deadline)?;
            if chunk.size != head.size || bytes.len() != len {
                return Err(EchoError::Protocol(
                    "the parameters' description changed while it was fetched".into(),
                ));
            }
            out.extend_from_slice(&bytes);
        }
        Ok(out)
    }

    /// Waits until the learner announced `min_version` (or a newer one).
    fn wait_announced(
        &self,
        view: &View,
        min_version: u64,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        let mut state = view.shared.state.lock();
        while self.params_version() < min_version {
            if let Some(err) = failure(&state) {
                return Err(err);
            }
            view.shared.wait(&mut state, deadline)?;
        }
        Ok(())
    }

    /// Sends one FETCH on `view`'s connection; the id its answer will carry.
    fn ask(
        &self,
        view: &View,
        asked: Fetch,
        size: u64,
        deadline: Option<Instant>,
    ) -> Result<u64, EchoError> {
        let mut link = self.link.lock();
        if !std::sync::Arc::ptr_eq(&link.view.shared, &view.shared) {
            return Err(EchoError::Disconnected("reconnected meanwhile".into()));
        }
        let id = {
            let mut state = view.shared.state.lock();
            let id = state.fetch.next_id;
            state.fetch.next_id += 1;
            state.fetch.asked.push_back((id, asked, size));
            id
        };
        if let Err(err) = link.write(&[&asked.encode()], deadline) {
            // Not sent (a full pipe at the deadline, a lost connection): not awaited either.
            view.shared.state.lock().fetch.asked.retain(|a| a.0 != id);
            return Err(err);
        }
        Ok(id)
    }

    /// Waits (until `deadline`) for the answer to the fetch `id`: its chunk and bytes.
    /// Answers to earlier fetches, given up, are dropped.
    fn answer(
        &self,
        view: &View,
        id: u64,
        deadline: Option<Instant>,
    ) -> Result<(Chunk, Vec<u8>), EchoError> {
        let mut state = view.shared.state.lock();
        loop {
            while state.fetch.answers.front().is_some_and(|a| a.0 < id) {
                state.fetch.answers.pop_front();
            }
            if state.fetch.answers.front().is_some_and(|a| a.0 == id) {
                let (_, chunk, bytes) = state.fetch.answers.pop_front().expect("there");
                return Ok((chunk, bytes));
            }
            if let Some(err) = failure(&state) {
                return Err(err);
            }
            view.shared.wait(&mut state, deadline)?;
        }
    }
}
