//! Waiting for acks, and what happens when a connection drops: reconnecting with backoff,
//! resuming the session and resending what was not acknowledged (`pump`), and `close`.

use std::io::Write;
use std::sync::atomic::Ordering::Acquire;
use std::thread;
use std::time::{Duration, Instant};

use super::connecting::Connecting;
use super::link::{Acks, Established};
use super::options::LOG_TARGET;
use super::{Recovery, TcpSender, BACKOFF_FIRST, BACKOFF_MAX, CONNECT_SLICE, SHM_SLICE};
use crate::error::EchoError;
use crate::sync::Arc;
use crate::transport::wire::v2::{self, Closing, FrameMeta};

impl TcpSender {
    /// Waits until every sent sample is acknowledged (or `deadline`), reconnecting and
    /// resending meanwhile if the client does.
    ///
    /// # Errors
    /// [`EchoError::Disconnected`] if the connection goes away first (and reconnecting gave
    /// up), [`EchoError::TimedOut`].
    pub fn wait(&mut self, deadline: Option<Instant>) -> Result<(), EchoError> {
        loop {
            if self.acked() >= self.sent {
                return Ok(());
            }
            self.ensure_usable()?;
            self.drive(deadline)?;
            match self.wait_for_acks(self.sent, deadline) {
                Err(EchoError::Disconnected(_)) if self.reconnect => {}
                other => return other,
            }
        }
    }

    /// Waits until the samples before `target` are acknowledged and persisted (durable
    /// acknowledgements), on the current connection.
    pub(super) fn wait_for_persisted(
        &self,
        target: u64,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        let Some(link) = &self.link else {
            return Err(EchoError::Disconnected(self.failure()));
        };
        wait_on(&link.acks, || self.releasable() >= target, deadline)
    }

    /// What a close waits for: every sent sample acknowledged ([`TcpSender::wait`]), and with
    /// durable acknowledgements persisted too ([`TcpSender::wait_persisted`]).
    ///
    /// # Errors
    /// As [`TcpSender::wait`].
    pub fn flush(&mut self, deadline: Option<Instant>) -> Result<(), EchoError> {
        self.wait(deadline)?;
        if self.durable.is_some() {
            self.wait_persisted(deadline)?;
        }
        Ok(())
    }

    /// Durable acknowledgements: waits until every sent sample is persisted (or `deadline`),
    /// reconnecting and resending meanwhile.
    ///
    /// # Errors
    /// As [`TcpSender::wait`].
    pub fn wait_persisted(&mut self, deadline: Option<Instant>) -> Result<(), EchoError> {
        loop {
            self.release();
            if self.releasable() >= self.sent {
                return Ok(());
            }
            self.ensure_usable()?;
            self.drive(deadline)?;
            match self.wait_for_persisted(self.sent, deadline) {
                Err(EchoError::Disconnected(_)) if self.reconnect => {}
                // Released at the top of the loop.
                Ok(()) => {}
                Err(err) => return Err(err),
            }
        }
    }

    /// Waits until at least `target` acks have arrived on the current connection.
    pub(super) fn wait_for_acks(
        &self,
        target: u64,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        if self.acked() >= target {
            return Ok(());
        }
        let Some(link) = &self.link else {
            return Err(EchoError::Disconnected(self.failure()));
        };
        let acks = &link.acks;
        if let Some(writer) = &link.shm {
            loop {
                if link.acked_total() >= target {
                    return Ok(());
                }
                if acks.is_lost() {
                    return Err(EchoError::Disconnected(acks.reason()));
                }
                let now = Instant::now();
                if deadline.is_some_and(|d| now >= d) {
                    return Err(EchoError::TimedOut);
                }
                let until = deadline.map_or(now + SHM_SLICE, |d| d.min(now + SHM_SLICE));
                writer.wait_taken(target.saturating_sub(link.base), until);
            }
        }
        wait_on(acks, || link.acked_total() >= target, deadline)
    }

    pub(super) fn failure(&self) -> String {
        if let Some(failed) = &self.failed {
            return failed.clone();
        }
        self.link.as_ref().map_or_else(|| "the connection is gone".into(), |l| l.acks.reason())
    }

    pub(super) fn ensure_usable(&self) -> Result<(), EchoError> {
        if self.closed {
            return Err(EchoError::Disconnected("the client was closed".into()));
        }
        if let Some(failed) = &self.failed {
            if self.final_close {
                return Err(EchoError::ServerClosed(failed.clone()));
            }
            return Err(EchoError::Disconnected(failed.clone()));
        }
        if !self.reconnect {
            if let Some(link) = &self.link {
                if link.acks.is_lost() {
                    return Err(EchoError::Disconnected(link.acks.reason()));
                }
            }
        }
        Ok(())
    }

    /// With reconnection: reconnects if the connection dropped, then writes every retained
    /// sample not yet written on this connection. Without: checks the connection.
    pub(super) fn drive(&mut self, deadline: Option<Instant>) -> Result<(), EchoError> {
        if !self.reconnect {
            return self.ensure_usable();
        }
        loop {
            self.recover(deadline)?;
            match self.pump(deadline) {
                Err(EchoError::Disconnected(_)) if self.failed.is_none() => {}
                other => return other,
            }
        }
    }

    /// Writes retained frames from `written` to `sent`.
    fn pump(&mut self, deadline: Option<Instant>) -> Result<(), EchoError> {
        while self.written < self.sent {
            // Drop what is acknowledged (durable: and persisted): it is never needed again.
            self.release();
            let index = usize::try_from(self.written - self.retained_base).expect("retained");
            if self.shm {
                self.pump_shm(index, deadline)?;
                self.written += 1;
                continue;
            }
            // Taken out while it is written (`write_frame` borrows the sender), then put back:
            // it stays retained until acknowledged. Retained raw; compressed as it is written
            // on a connection that sends compressed frames.
            let frame = std::mem::take(&mut self.retained[index].frame);
            let result = if self.wire_codecs().is_some() {
                let (meta, payload) =
                    FrameMeta::split(&frame).expect("a retained frame is well formed");
                let spec = &self.wire_spec;
                let leaves: Vec<&[u8]> =
                    (0..spec.len()).map(|leaf| &payload[spec.leaf_range(leaf)]).collect();
                self.write_sample(&meta, &[], &leaves, deadline)
            } else {
                self.write_frame(&[], &[&frame[..]], deadline)
            };
            self.retained[index].frame = frame;
            result?;
            self.written += 1;
        }
        Ok(())
    }

    /// Writes the retained frame `index` into a free shared-memory slot of the current
    /// connection and commits it, waiting (until `deadline`) as [`TcpSender::send_shm`] does.
    fn pump_shm(&mut self, index: usize, deadline: Option<Instant>) -> Result<(), EchoError> {
        // Taken out while it is written (`write_shm` borrows the sender), then put back.
        let frame = std::mem::take(&mut self.retained[index].frame);
        let (meta, payload) = FrameMeta::split(&frame).expect("a retained frame is well formed");
        let result = self.write_shm(&[payload], &meta, deadline);
        self.retained[index].frame = frame;
        result
    }

    /// Makes sure there is a live connection, reconnecting (until `deadline` in this call,
    /// until `reconnect_timeout` in all) if it dropped.
    pub(super) fn recover(&mut self, deadline: Option<Instant>) -> Result<(), EchoError> {
        if let Some(link) = &self.link {
            if !link.acks.is_lost() {
                return Ok(());
            }
            // ORDERING: Acquire pairs with the reader's Release store of `fatal`, made before
            // it set `lost` (which we saw).
            if link.acks.fatal.load(Acquire) {
                let reason = link.acks.reason();
                self.failed = Some(reason.clone());
                return Err(EchoError::Disconnected(reason));
            }
            // ORDERING: Acquire pairs with the reader's Release store of `closing`, made
            // before it set `lost` (which we saw).
            let closing = Closing::from_byte(link.acks.closing.load(Acquire));
            self.server_closing = closing.or(self.server_closing);
            if closing == Some(Closing::Final) && self.durable.is_some() {
                // A learner that closed for good took what it acknowledged (it drains or
                // drops it by its own choice): no restore will ask for it again, and a
                // client that moves to another server must not resend it there.
                let acked = link.acked_total().max(self.acked_floor);
                self.persisted_floor = self.persisted_floor.max(acked);
            }
            if closing == Some(Closing::Final) && self.config.resolver.is_none() {
                let reason = format!("{}: {}", self.address, link.acks.reason());
                self.failed = Some(reason.clone());
                self.final_close = true;
                return Err(EchoError::ServerClosed(reason));
            }
        }
        if let Some(mut link) = self.link.take() {
            // ORDERING: the reader has stopped counting once `lost` is set (Acquire above).
            self.acked_floor = self.acked_floor.max(link.acked_total());
            // ORDERING: Acquire, as in `persisted`.
            self.persisted_floor = self.persisted_floor.max(link.acks.persisted.load(Acquire));
            // ORDERING: Acquire, as in `params_version`.
            self.params_floor = self.params_floor.max(link.acks.params_version.load(Acquire));
            let reason = link.acks.reason();
            link.shut();
            log::warn!(
                target: LOG_TARGET, "{}: connection lost ({reason}); reconnecting",
                self.config.who(&self.address)
            );
            self.recovery = Some(Recovery {
                since: Instant::now(),
                attempt: 0,
                next_try: Instant::now(),
                connecting: None,
                last_error: reason,
            });
            // What needs no resending (durable: what a final close took) is forgotten before
            // the next hello claims where the client stands.
            self.release();
        }
        let timeout = self.config.reconnect_timeout.unwrap_or_default();
        loop {
            let recovery = self.recovery.as_mut().expect("reconnecting");
            let now = Instant::now();
            if now.duration_since(recovery.since) >= timeout {
                let reason = format!(
                    "could not reconnect to {} within {timeout:?}: {}",
                    self.address, recovery.last_error
                );
                self.failed = Some(reason.clone());
                return Err(EchoError::Disconnected(reason));
            }
            if deadline.is_some_and(|d| now >= d) {
                return Err(EchoError::TimedOut);
            }
            let slice_end = deadline.map_or(now + CONNECT_SLICE, |d| d.min(now + CONNECT_SLICE));
            let Some(connecting) = &mut recovery.connecting else {
                if now < recovery.next_try {
                    thread::sleep(recovery.next_try.min(slice_end) - now);
                    continue;
                }
                let until = recovery.since + timeout;
                let target = match &self.config.resolver {
                    None => Some(self.target.clone()),
                    Some(resolver) => {
                        let last = Some((self.target.0.as_str(), self.target.1, ""));
                        let last = last.map(|(h, p, _)| (h, p, recovery.last_error.as_str()));
                        match resolver.0.resolve(last) {
                            Ok(target) => target,
                            Err(err) => {
                                self.failed = Some(err.to_string());
                                return Err(err);
                            }
                        }
                    }
                };
                let Some(target) = target else {
                    recovery.last_error = "no server to connect to yet".into();
                    recovery.attempt += 1;
                    recovery.next_try = Instant::now() + backoff(recovery.attempt);
                    continue;
                };
                if target != self.target {
                    log::info!(
                        target: LOG_TARGET, "{}: reconnecting to {}:{} instead",
                        self.config.who(&self.address),
                        target.0,
                        target.1
                    );
                    self.address = format!("{}:{}", target.0, target.1);
                    self.target = target.clone();
                    // A new server, a new session: one server's session must not be resumed
                    // with what another acknowledged (a server refuses a claim past what its
                    // session queued), and a client sent back to a server it left comes back
                    // as a new session there, resending from what is acknowledged. A durable
                    // client keeps its session: a learner restored elsewhere (a restarted
                    // shard) knows it from its checkpoint and resumes it exactly, and a server
                    // that does not starts it at the persisted mark, from which the client
                    // resends everything not persisted.
                    if self.durable.is_none() {
                        self.session = v2::random()?;
                    }
                }
                // A durable client claims only what is persisted: a restored server's
                // session may stand anywhere from there (and a new one starts there).
                let first_seq =
                    if self.durable.is_some() { self.retained_base } else { self.acked_floor };
                recovery.connecting = Some(Connecting::start(
                    Arc::clone(&self.config),
                    target,
                    self.session,
                    first_seq,
                    Some(until),
                )?);
                continue;
            };
            match connecting.poll_established(slice_end) {
                Ok(None) => {}
                Ok(Some(est)) => return self.resume(est),
                Err(err @ (EchoError::Auth(_) | EchoError::Protocol(_))) => {
                    self.failed = Some(err.to_string());
                    return Err(err);
                }
                Err(err) => {
                    recovery.last_error = err.to_string();
                    recovery.attempt += 1;
                    recovery.connecting = None;
                    recovery.next_try = Instant::now() + backoff(recovery.attempt);
                }
            }
        }
    }

    /// Continues on a new connection: drops what the server already has, resends the rest.
    pub(super) fn resume(&mut self, est: Established) -> Result<(), EchoError> {
        let Some(accept) = &est.accept else {
            let reason = format!(
                "reconnected to {}, which now speaks only wire protocol 1: cannot resume",
                self.address
            );
            self.failed = Some(reason.clone());
            return Err(EchoError::Disconnected(reason));
        };
        let resume = accept.resume_seq;
        if resume > self.sent {
            let reason = format!(
                "the server at {} resumed at sample {resume}, past the {} sent",
                self.address, self.sent
            );
            self.failed = Some(reason.clone());
            return Err(EchoError::Disconnected(reason));
        }
        self.replay = accept.replay;
        self.steps = accept.steps;
        // The server has every sample before `resume`: none needs resending. A durable
        // client keeps them until they are persisted (`release`).
        if self.durable.is_none() {
            while self.retained_base < resume && !self.retained.is_empty() {
                self.release_front();
                self.retained_base += 1;
            }
        }
        self.acked_floor = resume;
        self.written = resume;
        self.in_progress = 0;
        self.resent += self.sent - resume;
        self.reconnects += 1;
        self.resumed_from = Some(resume);
        self.recovery = None;
        log::info!(
            target: LOG_TARGET, "{}: reconnected; resending {} samples from sample {resume}",
            self.config.who(&self.address),
            self.sent - resume
        );
        self.install(est)
    }

    /// Flushes (waits for every ack, until `deadline`), says goodbye (v2: the server forgets
    /// the session), closes the socket and joins the ack reader. Idempotent. Returns whether
    /// every sent sample was acknowledged.
    pub fn close(&mut self, deadline: Option<Instant>) -> bool {
        if self.closed {
            return self.acked() >= self.sent;
        }
        let flushed = self.flush(deadline).is_ok();
        self.closed = true;
        if let Some(mut link) = self.link.take() {
            self.acked_floor = self.acked_floor.max(link.acked_total());
            // ORDERING: Acquire, as in `persisted`.
            self.persisted_floor = self.persisted_floor.max(link.acks.persisted.load(Acquire));
            if link.version == 2 && flushed && !link.acks.is_lost() {
                let _guard = link.writing.lock();
                let _ = link.stream.write_all(&[v2::BYE]);
            }
            link.acks.lose("the client was closed".into());
            link.shut();
        }
        flushed
    }
}

/// The pause before reconnection attempt `attempt` (from 1): doubling from
/// [`BACKOFF_FIRST`] up to [`BACKOFF_MAX`], jittered to 50-100% so that a fleet of workers
/// does not reconnect in lockstep.
pub(super) fn backoff(attempt: u32) -> Duration {
    let base = BACKOFF_FIRST.saturating_mul(1 << attempt.min(16)).min(BACKOFF_MAX);
    let jitter = v2::random::<1>().map_or(255, |b| b[0]);
    base / 2 + base.mul_f64(f64::from(jitter) / 510.0)
}

/// Waits on the reader's signal until `done` (`Ok`), the connection is lost
/// ([`EchoError::Disconnected`]) or `deadline` passes ([`EchoError::TimedOut`]).
pub(super) fn wait_on(
    acks: &Acks,
    done: impl Fn() -> bool,
    deadline: Option<Instant>,
) -> Result<(), EchoError> {
    let reached = acks.changed.wait_until(|| done() || acks.is_lost(), deadline);
    if done() {
        Ok(())
    } else if acks.is_lost() {
        Err(EchoError::Disconnected(acks.reason()))
    } else {
        debug_assert!(!reached);
        Err(EchoError::TimedOut)
    }
}
