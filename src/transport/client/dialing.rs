//! A first connection with retries ([`Dialing`]): [`Connecting`] attempts, asking the
//! resolver each time and backing off, until one succeeds, one fails for good, or the
//! deadline passes.

use std::io;
use std::thread;
use std::time::{Duration, Instant};

use super::connecting::Connecting;
use super::options::ClientConfig;
use super::options::LOG_TARGET;
use super::recovery::backoff;
use super::TcpSender;
use crate::error::EchoError;
use crate::sync::Arc;

/// A first connection being made ([`TcpSender::connecting`]).
///
/// Without retries it is one [`Connecting`] attempt, whose error is the connect's. A client
/// that reconnects, or has a resolver, also retries its first connection: a worker started
/// before its learner listens (or before any learner is registered) waits for it. Refused,
/// reset or timed-out attempts and closed handshakes are tried again after the reconnection
/// backoff, asking the resolver each time, until the deadline; then the error is a
/// `TimedOut` one naming the last address and why it failed. Errors that another attempt
/// would only repeat (a layout, token or protocol refusal, `SharedMemory::Required` not
/// met, the resolver's own) end it at once.
pub struct Dialing {
    pub(super) config: Arc<ClientConfig>,
    pub(super) session: [u8; 16],
    pub(super) retry: bool,
    pub(super) started: Instant,
    pub(super) deadline: Option<Instant>,
    pub(super) attempt_timeout: Option<Duration>,
    /// Failed attempts so far.
    pub(super) attempt: u32,
    pub(super) next_try: Instant,
    pub(super) current: Option<Connecting>,
    /// The previous attempt's address and why it failed.
    pub(super) last: Option<((String, u16), String)>,
}

impl Dialing {
    /// Waits until `until` (or the deadline, if sooner) for a connection. `Ok(None)`: not
    /// yet, call again.
    ///
    /// # Errors
    /// As [`Connecting::poll`]; with retries, a `TimedOut` [`EchoError::Io`] once the
    /// deadline passes, and whatever the resolver returned.
    pub fn poll(&mut self, until: Instant) -> Result<Option<TcpSender>, EchoError> {
        loop {
            let now = Instant::now();
            let until = self.deadline.map_or(until, |d| d.min(until));
            let Some(connecting) = &mut self.current else {
                if self.deadline.is_some_and(|d| now >= d) && self.last.is_some() {
                    return Err(self.timed_out());
                }
                if now < self.next_try {
                    if now >= until {
                        return Ok(None);
                    }
                    thread::sleep(self.next_try.min(until) - now);
                    continue;
                }
                let last = self.last.as_ref().map(|((h, p), why)| (h.as_str(), *p, why.as_str()));
                let target = match &self.config.resolver {
                    None => Some((self.config.host.clone(), self.config.port)),
                    Some(resolver) => resolver.0.resolve(last)?,
                };
                let Some(target) = target else {
                    let fallback = (self.config.host.clone(), self.config.port);
                    let target = self.last.take().map_or(fallback, |(target, _)| target);
                    self.failed(target, "no server to connect to yet".into());
                    continue;
                };
                let mut deadline = self.deadline;
                if self.retry {
                    if let Some(each) = self.attempt_timeout {
                        let end = now.checked_add(each);
                        deadline = match (deadline, end) {
                            (Some(d), Some(e)) => Some(d.min(e)),
                            (d, e) => d.or(e),
                        };
                    }
                }
                let config = Arc::clone(&self.config);
                self.current = Some(Connecting::start(config, target, self.session, 0, deadline)?);
                continue;
            };
            match connecting.poll_established(until) {
                Ok(None) if Instant::now() < until => {}
                Ok(None) => return Ok(None),
                Ok(Some(est)) => return Ok(Some(TcpSender::from_established(connecting, est))),
                Err(err @ (EchoError::Io(_) | EchoError::Disconnected(_))) if self.retry => {
                    let target = connecting.target.clone();
                    self.current = None;
                    self.failed(target, err.to_string());
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// Records a failed attempt at `target` and when to try again.
    pub(super) fn failed(&mut self, target: (String, u16), why: String) {
        self.attempt += 1;
        let address = format!("{}:{}", target.0, target.1);
        log::debug!(target: LOG_TARGET, "{}: connecting failed ({why}); trying again", self.config.who(&address));
        self.last = Some((target, why));
        self.next_try = Instant::now() + backoff(self.attempt);
    }

    fn timed_out(&self) -> EchoError {
        let (address, why) = match &self.last {
            Some(((host, port), why)) => (format!("{host}:{port}"), why.as_str()),
            None => (format!("{}:{}", self.config.host, self.config.port), "no attempt"),
        };
        EchoError::Io(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "could not connect to {address} within {:.1?} ({} attempts; the last: {why})",
                self.started.elapsed(),
                self.attempt
            ),
        ))
    }
}
