//! A server's checkpoints: what it records of its own settings, the write with the ingress's
//! acknowledged samples captured at the snapshot's moment, and a restore into a new server.

use std::path::Path;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::{LastCheckpoint, Server};
use crate::backend::BackendConfig;
use crate::checkpoint::manifest::{CodecEntry, SessionEntry, Strategy};
use crate::checkpoint::{self, Example, Extra, OpenedCheckpoint, Settings, Stage, Tuning};
use crate::error::EchoError;
use crate::transport::TcpIngress;

impl Server {
    /// The settings that are part of the data, as a checkpoint records them.
    pub fn checkpoint_settings(&self) -> Settings {
        let mut settings = Settings::new(self.backend.batch_size());
        let (replay, sequence) = match &self.config.backend {
            BackendConfig::Fifo { num_batches, .. } => {
                settings.num_buffers = Some(*num_batches);
                return settings;
            }
            BackendConfig::Replay(replay) => (replay, None),
            BackendConfig::Sequence(replay, sequence) => (replay, Some(sequence)),
        };
        settings.max_size = Some(replay.max_size);
        settings.sampler = Some(Strategy::sampler(replay.sampler));
        settings.remover = Some(Strategy::remover(replay.remover));
        settings.rate_limiter = Some(Strategy::rate_limiter(replay.rate_limit));
        settings.max_times_sampled = Some(replay.max_times_sampled);
        settings.sequence = sequence.map(Strategy::sequence);
        settings
    }

    /// The settings that only tune the server, as a checkpoint records them.
    pub fn checkpoint_tuning(&self) -> Tuning {
        // The sample's leaves only: a version leaf is never compressed.
        let leaves = self.backend().spec().len() - usize::from(self.versions.is_some());
        let codecs = &self.config.wire_codecs[..self.config.wire_codecs.len().min(leaves)];
        let bound = self.versions.as_ref().and_then(|v| v.max_staleness().map(|k| (k, v)));
        let max_bytes = match &self.config.backend {
            BackendConfig::Fifo { .. } => None,
            BackendConfig::Replay(replay) | BackendConfig::Sequence(replay, _) => replay.max_bytes,
        };
        Tuning {
            num_drainers: Some(self.config.num_drainers),
            producer_queue_size: Some(self.config.producer_queue_size),
            compress: codecs
                .iter()
                .any(Option::is_some)
                .then(|| codecs.iter().map(|c| c.map(CodecEntry)).collect()),
            max_bytes,
            name: self.config.name.clone(),
            max_staleness: bound.map(|(k, _)| k),
            admission: bound.map(|(_, v)| match v.admission() {
                crate::versions::Admission::Drop => "drop".to_owned(),
                crate::versions::Admission::Block => "block".to_owned(),
            }),
        }
    }

    /// Writes a checkpoint of this server to `path` (see [`checkpoint::write()`]): its data,
    /// the acknowledged samples its ingress holds, `example`'s layout and the learner's
    /// `extra`; records it for [`Server::snapshot`] once complete. Inserts and sampling go on
    /// meanwhile. Returns the bytes its files hold.
    ///
    /// # Errors
    /// As [`checkpoint::write()`].
    pub fn checkpoint(
        &self,
        path: &Path,
        example: &Example,
        extra: Option<Extra<'_>>,
        hook: &mut dyn FnMut(Stage) -> Result<(), EchoError>,
    ) -> Result<u64, EchoError> {
        let started = Instant::now();
        let request = checkpoint::CheckpointRequest {
            path,
            settings: self.checkpoint_settings(),
            tuning: self.checkpoint_tuning(),
            example,
            extra,
        };
        // Durable sessions' marks are taken with the capture, and their clients told once
        // the checkpoint is complete (never for one that failed).
        let durable = self.tcp.lock().as_ref().map(TcpIngress::durability);
        let mut marks = Vec::new();
        let capture = || {
            let mut queued = self.queued_now();
            if let Some(durable) = &durable {
                queued.sessions = durable.marks();
                marks.clone_from(&queued.sessions);
            }
            queued
        };
        let bytes = checkpoint::write(&self.backend, capture, request, hook)?;
        if let Some(durable) = &durable {
            durable.persisted(&marks);
        }
        let unix_s = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        self.record_checkpoint(LastCheckpoint {
            unix_s,
            duration_s: started.elapsed().as_secs_f64(),
            bytes,
        });
        Ok(bytes)
    }

    /// Fills this new server (built from `opened`'s settings and example) with the
    /// checkpoint's data; `npy_descrs[l]` is leaf `l`'s dtype as a `.npy` header spells it.
    ///
    /// # Errors
    /// [`EchoError::Checkpoint`] naming what does not fit; nothing is inserted then.
    pub fn restore(
        &self,
        opened: &OpenedCheckpoint,
        npy_descrs: &[String],
    ) -> Result<(), EchoError> {
        opened.restore_into(&self.backend, npy_descrs)?;
        let marks = opened.manifest().sessions.iter().filter_map(SessionEntry::mark).collect();
        *self.restored_sessions.lock() = marks;
        Ok(())
    }
}
