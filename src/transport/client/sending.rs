//! Sending samples: single samples and rows, as one vectored write or into a shared-memory
//! slot; the checks a sample passes first; retaining unacknowledged frames for a resend; and
//! the frame bytes (header, compressed body).

use std::io::{self, IoSlice, Write};
use std::time::Instant;

use super::{Retained, TcpSender, MAX_IOVECS, SHM_SLICE};

/// How often a send held back by admission looks at the learner's version again.
const ADMISSION_SLICE: std::time::Duration = std::time::Duration::from_millis(5);
use crate::codec::LeafCodecs;
use crate::error::EchoError;
use crate::source::{Leaves, Rows, SampleSource};
use crate::transport::wire::v2::{self, FrameMeta};

impl TcpSender {
    /// Sends one sample given as its leaves (sizes are checked against the spec here), with
    /// `priority` (v2 replay servers only). Waits first while `max_inflight` samples are
    /// unacknowledged; returns [`EchoError::TimedOut`] if `deadline` passes while waiting
    /// (nothing was sent).
    ///
    /// Once the first byte is written the sample must be finished, or the stream would be
    /// misaligned: if `deadline` passes mid-write this returns [`EchoError::Stalled`], and
    /// the next `send` (with the same leaves) continues where it stopped. [`TcpSender::abort`]
    /// gives up instead (the server discards the partial sample). With reconnection the
    /// sample is kept until acknowledged and a dropped connection is reconnected first.
    ///
    /// # Errors
    /// [`EchoError::Disconnected`] once the connection is gone (and reconnecting gave up);
    /// [`EchoError::Protocol`]/[`EchoError::Priority`] for leaves or a priority the server
    /// cannot take.
    pub fn send(
        &mut self,
        leaves: &[&[u8]],
        meta: FrameMeta,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        self.send_as(leaves, meta, deadline, None)
    }

    /// [`TcpSender::send`] of a sample made by policy `version` (`None`: the client's
    /// [`TcpSender::policy_version`]), which its payload carries when the server keeps
    /// versions (otherwise it is ignored). With blocking admission, a new sample first waits
    /// (until `deadline`: [`EchoError::TimedOut`], nothing sent) while this worker is more
    /// than the bound behind the learner's latest version: until it fetches newer parameters
    /// (another thread, between sliced calls) or names a newer `version`.
    ///
    /// # Errors
    /// As [`TcpSender::send`].
    pub fn send_as(
        &mut self,
        leaves: &[&[u8]],
        meta: FrameMeta,
        deadline: Option<Instant>,
        version: Option<u64>,
    ) -> Result<(), EchoError> {
        self.ensure_usable()?;
        if self.carry {
            self.drive(deadline)?;
            self.carry = false;
            return Ok(());
        }
        let starts = self.in_progress == 0;
        if starts {
            self.check_leaves(leaves)?;
            self.check_meta(&meta)?;
            self.start_frame(version, deadline)?;
        }
        let stamp = self.frame_version.to_le_bytes();
        let mut stamped: Vec<&[u8]> = Vec::new();
        let leaves = if self.versions.is_some() {
            stamped.reserve_exact(leaves.len() + 1);
            stamped.extend_from_slice(leaves);
            stamped.push(&stamp);
            &stamped[..]
        } else {
            leaves
        };
        if self.shm && !self.reconnect {
            return self.send_shm(leaves, &meta, deadline);
        }
        if starts {
            loop {
                self.drive(deadline)?;
                let target = (self.sent + 1).saturating_sub(self.config.max_inflight);
                match self.wait_for_acks(target, deadline) {
                    Err(EchoError::Disconnected(_)) if self.reconnect => {}
                    other => break other?,
                }
            }
        }
        let (header, header_len) = frame_header(self.version, &meta, false);
        let header = &header[..header_len];
        if let Some(budget) = self.durable {
            self.make_room(header_len + self.wire_spec.payload_size(), budget, deadline)?;
        }
        if self.reconnect {
            self.retain(header, leaves);
            self.sent += 1;
            self.carry = true;
            self.drive(deadline)?;
            self.carry = false;
            return Ok(());
        }
        self.write_sample(&meta, header, leaves, deadline)?;
        self.sent += 1;
        self.written = self.sent;
        Ok(())
    }

    /// Whether this worker is more than `admit` versions behind the learner's latest.
    fn behind(&self, admit: u64) -> bool {
        self.params_version().saturating_sub(self.newest_version) > admit
    }

    /// Before a new sample: the version it carries (`version`, or the client's), and with
    /// blocking admission the wait while this worker is too far behind (see
    /// [`TcpSender::send_as`]).
    fn start_frame(
        &mut self,
        version: Option<u64>,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        if let Some(v) = version {
            self.newest_version = self.newest_version.max(v);
        }
        self.frame_version = version.unwrap_or(self.policy_version);
        let Some(admit) = self.versions.filter(|&admit| admit != u64::MAX) else {
            return Ok(());
        };
        let started = Instant::now();
        if !self.behind(admit) {
            self.admission_blocked = false;
            return Ok(());
        }
        if !self.admission_blocked {
            self.admission_waits += 1;
            self.admission_blocked = true;
        }
        // Nothing this call does can fetch: another thread does, between sliced calls (or
        // the learner's version notice is what was missing). Wait out the slice.
        let result = loop {
            let now = Instant::now();
            if !self.behind(admit) {
                self.admission_blocked = false;
                break Ok(());
            }
            if deadline.is_some_and(|d| now >= d) {
                break Err(EchoError::TimedOut);
            }
            let pause = deadline.map_or(ADMISSION_SLICE, |d| (d - now).min(ADMISSION_SLICE));
            std::thread::sleep(pause);
        };
        self.admission_wait_s += started.elapsed().as_secs_f64();
        result
    }

    /// Writes one sample (`header` + `leaves`, whose fields are `meta`) on the current
    /// connection from byte `in_progress` on, as [`TcpSender::write_frame`]: compressed when
    /// the connection sends compressed frames. The compressed frame is made once, when its
    /// first byte is due, and kept until it is wholly written.
    pub(super) fn write_sample(
        &mut self,
        meta: &FrameMeta,
        header: &[u8],
        leaves: &[&[u8]],
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        let Some(codecs) = self.link.as_ref().and_then(|link| link.codecs.clone()) else {
            return self.write_frame(header, leaves, deadline);
        };
        if self.in_progress == 0 {
            pack_frame(&codecs, meta, leaves, &mut self.packing);
        }
        // Taken out while it is written (`write_frame` borrows the sender), then put back.
        let frame = std::mem::take(&mut self.packing);
        let result = self.write_frame(&[], &[&frame], deadline);
        self.packing = frame;
        result
    }

    /// Sends the rows of `rows` from `*done` on, in order, advancing `*done` as each is wholly
    /// written: as many frames per vectored write as the in-flight window has room for (one
    /// system call for a window-full, not one per sample). Waits for room like
    /// [`TcpSender::send`]; on [`EchoError::TimedOut`] or [`EchoError::Stalled`] call again
    /// with the same `rows` and `done` to continue (a row half written is finished first).
    /// With reconnection each row goes through [`TcpSender::send`] (it is kept until
    /// acknowledged).
    ///
    /// # Errors
    /// As [`TcpSender::send`], for the row at `*done`.
    pub fn send_rows(
        &mut self,
        rows: &Rows<'_>,
        done: &mut usize,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        self.send_rows_as(rows, done, deadline, None)
    }

    /// [`TcpSender::send_rows`] of samples made by policy `version` (see
    /// [`TcpSender::send_as`]).
    ///
    /// # Errors
    /// As [`TcpSender::send`], for the row at `*done`.
    pub fn send_rows_as(
        &mut self,
        rows: &Rows<'_>,
        done: &mut usize,
        deadline: Option<Instant>,
        version: Option<u64>,
    ) -> Result<(), EchoError> {
        let n = rows.num_samples();
        let leaf_count = self.spec.len();
        if *done == 0 && self.in_progress == 0 && !self.carry {
            for i in 0..n {
                self.check_meta(&self.row_meta(rows, i))?;
            }
        }
        let mut row: Vec<&[u8]> = Vec::with_capacity(leaf_count);
        if self.reconnect || self.shm || self.wire_codecs().is_some() {
            while *done < n {
                row.clear();
                row.extend((0..leaf_count).map(|leaf| rows.row_leaf(*done, leaf)));
                self.send_as(&row, self.row_meta(rows, *done), deadline, version)?;
                *done += 1;
            }
            return Ok(());
        }
        self.ensure_usable()?;
        if self.in_progress == 0 {
            self.start_frame(version, deadline)?;
        }
        let stamp = self.frame_version.to_le_bytes();
        let stamped = self.versions.is_some();
        // Every frame of the batch has the same header length: step frames throughout for a
        // sequence table (row 0 too), priorities for all rows or none.
        let steps = self.steps.is_some();
        let header_len = frame_header(self.version, &self.row_meta(rows, 0), steps).1;
        let frame_len = header_len + self.wire_spec.payload_size();
        // At most this many frames per write (each is a header, the leaves' rows and the
        // version).
        let per_write = (MAX_IOVECS / (leaf_count + 2)).max(1);
        while *done < n {
            if self.in_progress == 0 {
                let target = (self.sent + 1).saturating_sub(self.config.max_inflight);
                self.wait_for_acks(target, deadline)?;
            }
            let in_flight = self.sent.saturating_sub(self.acked());
            let room = usize::try_from(self.config.max_inflight.saturating_sub(in_flight))
                .unwrap_or(usize::MAX)
                .max(1);
            let k = room.min(n - *done).min(per_write);
            let headers: Vec<([u8; FrameMeta::MAX_HEADER], usize)> = (0..k)
                .map(|j| frame_header(self.version, &self.row_meta(rows, *done + j), steps))
                .collect();
            let mut parts: Vec<&[u8]> = Vec::with_capacity(k * (leaf_count + 2));
            for (j, (header, len)) in headers.iter().enumerate() {
                parts.push(&header[..*len]);
                parts.extend((0..leaf_count).map(|leaf| rows.row_leaf(*done + j, leaf)));
                if stamped {
                    parts.push(&stamp);
                }
            }
            let result = self.write_frame(&[], &parts, deadline);
            // `write_frame` counts bytes across the frames: whole ones are sent.
            let written = match &result {
                Ok(()) => k * frame_len,
                Err(_) => self.in_progress,
            };
            let whole = written / frame_len;
            self.sent += whole as u64;
            self.written = self.sent;
            *done += whole;
            self.in_progress = written % frame_len;
            result?;
        }
        Ok(())
    }

    /// Writes one sample into a free shared-memory slot and commits it, waiting (until
    /// `deadline`) while `min(max_inflight, slots)` samples are not yet taken by the server.
    /// A sample is never half sent: it is written whole, then committed.
    pub(super) fn send_shm(
        &mut self,
        leaves: &[&[u8]],
        meta: &FrameMeta,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        self.write_shm(leaves, meta, deadline)?;
        self.sent += 1;
        self.written = self.sent;
        Ok(())
    }

    /// [`TcpSender::send_shm`]'s write and wait, counting nothing.
    pub(super) fn write_shm(
        &mut self,
        leaves: &[&[u8]],
        meta: &FrameMeta,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        let max_inflight = self.config.max_inflight;
        loop {
            let failure = self.failure();
            let link = self.link.as_mut().ok_or(EchoError::Disconnected(failure))?;
            if link.acks.is_lost() {
                return Err(EchoError::Disconnected(link.acks.reason()));
            }
            let writer = link.shm.as_mut().expect("a shared-memory link");
            let window = max_inflight.min(writer.slots() as u64);
            let in_flight = writer.committed() - writer.taken();
            if in_flight < window && writer.try_send(leaves, meta) {
                return Ok(());
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Err(EchoError::TimedOut);
            }
            let until = deadline.map_or(now + SHM_SLICE, |d| d.min(now + SHM_SLICE));
            writer.wait_taken(writer.committed() + 1 - window, until);
        }
    }

    /// Keeps a copy of the frame `header` + `leaves` until it is acknowledged, in a buffer
    /// of an acknowledged frame of the same size when there is one (so a steady stream
    /// allocates nothing per sample).
    fn retain(&mut self, header: &[u8], leaves: &[&[u8]]) {
        let len = header.len() + self.wire_spec.payload_size();
        let mut frame = match self.spare.iter().position(|f| f.len() == len) {
            Some(i) => self.spare.swap_remove(i),
            None => vec![0u8; len].into_boxed_slice(),
        };
        let mut at = header.len();
        frame[..at].copy_from_slice(header);
        for leaf in leaves {
            frame[at..at + leaf.len()].copy_from_slice(leaf);
            at += leaf.len();
        }
        self.retained_bytes += frame.len();
        self.retained.push_back(Retained { frame });
    }

    /// Forgets every retained frame nothing needs any more: acknowledged, and with durable
    /// acknowledgements persisted too.
    pub(super) fn release(&mut self) {
        let upto = self.releasable();
        while self.retained_base < upto && !self.retained.is_empty() {
            self.release_front();
            self.retained_base += 1;
        }
    }

    /// Durable acknowledgements: waits until a frame of `len` bytes fits in `budget` beside
    /// the frames kept until they are persisted (or nothing is kept: a frame larger than the
    /// budget goes alone), reconnecting meanwhile. Counts the wait.
    ///
    /// # Errors
    /// [`EchoError::TimedOut`] at `deadline` (nothing was sent), or as [`TcpSender::send`].
    fn make_room(
        &mut self,
        len: usize,
        budget: usize,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        let mut waited = None;
        let result = loop {
            self.release();
            if self.retained.is_empty() || self.retained_bytes + len <= budget {
                self.budget_blocked = false;
                break Ok(());
            }
            if !std::mem::replace(&mut self.budget_blocked, true) {
                // One wait, however many calls (a deadline cut into slices) it takes.
                self.durable_waits += 1;
            }
            waited.get_or_insert_with(Instant::now);
            if let Err(err) = self.drive(deadline) {
                break Err(err);
            }
            match self.wait_for_persisted(self.retained_base + 1, deadline) {
                Err(EchoError::Disconnected(_)) if self.reconnect => {}
                Err(err) => break Err(err),
                Ok(()) => {}
            }
        };
        if let Some(since) = waited {
            self.durable_wait_s += since.elapsed().as_secs_f64();
        }
        result
    }

    /// Forgets the oldest retained frame (acknowledged), keeping its buffer for reuse.
    pub(super) fn release_front(&mut self) {
        if let Some(old) = self.retained.pop_front() {
            self.retained_bytes -= old.frame.len();
            // At most two buffers: one of each frame size (with and without a priority).
            if self.spare.len() < 2 {
                self.spare.push(old.frame);
            }
        }
    }

    /// Row `i` of `rows` as a frame's fields: its priority and, for a sequence table, its row
    /// (row `i` of the batch is this client's stream `i`) and episode flag.
    fn row_meta(&self, rows: &Rows<'_>, i: usize) -> FrameMeta {
        let step = rows.step(i);
        let row =
            if self.steps.is_some() { u32::try_from(step.stream).unwrap_or(u32::MAX) } else { 0 };
        FrameMeta { priority: rows.row_priority(i), row, end: step.end }
    }

    /// Checks what a sample frame would carry: a priority the server takes, and steps (a row
    /// other than 0, an episode end) only for a sequence table, rows within its `max_rows`.
    pub(super) fn check_meta(&self, meta: &FrameMeta) -> Result<(), EchoError> {
        self.check_priority(meta.priority)?;
        if !meta.is_step() {
            return Ok(());
        }
        match self.steps {
            None => Err(EchoError::Protocol(format!(
                "end_episode/truncated and rows of episodes need a sequence table at the server; \
                 the server at {} {}",
                self.address,
                if self.version == 1 {
                    "speaks wire protocol 1, which has no episodes"
                } else if self.replay {
                    "is a replay table without sequence="
                } else {
                    "is a FIFO server"
                }
            ))),
            Some(max) if meta.row >= max => Err(EchoError::Protocol(format!(
                "row {} out of range: the sequence table at {} takes rows 0 to {} per client \
                 (its Sequence(max_streams={max}))",
                meta.row,
                self.address,
                max - 1
            ))),
            Some(_) => Ok(()),
        }
    }

    pub(super) fn check_priority(&self, priority: Option<f64>) -> Result<(), EchoError> {
        let Some(priority) = priority else { return Ok(()) };
        if self.version == 1 {
            return Err(EchoError::Protocol(format!(
                "a priority needs wire protocol 2, and the server at {} speaks 1",
                self.address
            )));
        }
        if !self.replay {
            return Err(EchoError::Priority(
                "the server's FIFO ring has no priorities: a priority needs a replay table".into(),
            ));
        }
        if !(priority.is_finite() && priority >= 0.0) {
            return Err(EchoError::Priority(format!(
                "priority must be a finite number >= 0, got {priority}"
            )));
        }
        Ok(())
    }

    /// Closes the connection in the middle of a sample (after an interrupt): the server
    /// discards the partial sample; every later call returns [`EchoError::Disconnected`].
    pub fn abort(&mut self, reason: &str) {
        self.failed.get_or_insert_with(|| reason.to_owned());
        if let Some(link) = &mut self.link {
            // The reason first: the reader thread reports its own once the socket shuts down.
            link.acks.lose(reason.to_owned());
            link.shut();
        }
        self.in_progress = 0;
        self.carry = false;
    }

    fn check_leaves(&self, leaves: &[&[u8]]) -> Result<(), EchoError> {
        if leaves.len() != self.spec.len() {
            return Err(EchoError::LeafCount { expected: self.spec.len(), got: leaves.len() });
        }
        for (i, (leaf, array)) in leaves.iter().zip(self.spec.arrays()).enumerate() {
            if leaf.len() != array.num_bytes() {
                return Err(EchoError::SizeMismatch {
                    leaf: i,
                    expected: array.num_bytes(),
                    got: leaf.len(),
                });
            }
        }
        Ok(())
    }

    /// Writes one frame (`header`, then `parts`) from byte `in_progress` on, until done or
    /// `deadline` passes.
    pub(super) fn write_frame(
        &mut self,
        header: &[u8],
        parts: &[&[u8]],
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        let link =
            self.link.as_mut().ok_or_else(|| EchoError::Disconnected("no connection".into()))?;
        let mut slices: Vec<IoSlice<'_>> = std::iter::once(header)
            .chain(parts.iter().copied())
            .filter(|l| !l.is_empty())
            .map(IoSlice::new)
            .collect();
        let mut remaining = &mut slices[..];
        IoSlice::advance_slices(&mut remaining, self.in_progress);
        let mut writing = link.writing.lock();
        while !remaining.is_empty() {
            match link.stream.write_vectored(remaining) {
                Ok(0) => {
                    link.acks.lose("the server stopped reading (write returned 0)".into());
                    return Err(EchoError::Disconnected(link.acks.reason()));
                }
                Ok(n) => {
                    self.in_progress += n;
                    writing.mid_frame = true;
                    writing.last_write = Instant::now();
                    IoSlice::advance_slices(&mut remaining, n);
                }
                Err(e)
                    if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) =>
                {
                    // The server is applying backpressure; keep going unless it vanished or
                    // the caller wants control back.
                    if link.acks.is_lost() {
                        return Err(EchoError::Disconnected(link.acks.reason()));
                    }
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(if self.in_progress == 0 {
                            EchoError::TimedOut
                        } else {
                            EchoError::Stalled
                        });
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    link.acks.lose(format!("sending failed: {e}"));
                    return Err(EchoError::Disconnected(link.acks.reason()));
                }
            }
        }
        writing.mid_frame = false;
        self.in_progress = 0;
        Ok(())
    }
}

/// The bytes before a sample's payload, on the stack (`header[..len]`): none on v1; the frame
/// type and fields on v2 ([`FrameMeta::encode`]; a step frame for any row with `step`).
fn frame_header(version: u8, meta: &FrameMeta, step: bool) -> ([u8; FrameMeta::MAX_HEADER], usize) {
    if version == 1 {
        return ([0u8; FrameMeta::MAX_HEADER], 0);
    }
    meta.encode_as(step)
}

/// A compressed frame of the sample `leaves` with fields `meta` into `out` (cleared first):
/// its header with [`v2::PACKED`] set, the body's length, and the body ([`LeafCodecs`]).
fn pack_frame(codecs: &LeafCodecs, meta: &FrameMeta, leaves: &[&[u8]], out: &mut Vec<u8>) {
    out.clear();
    let (mut header, len) = meta.encode();
    header[0] |= v2::PACKED;
    out.extend_from_slice(&header[..len]);
    out.extend_from_slice(&[0; 4]);
    let body = out.len();
    codecs.pack_body(&Leaves(leaves), 0, out);
    let body_len = u32::try_from(out.len() - body).expect("a body is far below 4 GiB");
    out[body - 4..body].copy_from_slice(&body_len.to_le_bytes());
}
