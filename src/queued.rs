//! The acknowledged samples a checkpoint finds outside the backend: those the ingress still
//! holds at the backend's snapshot moment (its `Ingress::capture`), written beside the
//! backend's snapshot and inserted first again on restore. A plain value, below both the
//! ingress (which fills it) and the backends (which keep it with their snapshot and restore
//! it), so neither needs the other for a checkpoint.

use crate::source::StepTag;

/// How far a durable session's samples reach in a checkpoint: every sample of session `id`
/// before `seq` is in it (in the backend's snapshot or among the queued samples), none after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionMark {
    /// The session's id (the client's, kept across its reconnects).
    pub id: [u8; 16],
    /// The sequence number of its first sample the checkpoint does not hold.
    pub seq: u64,
}

/// Acknowledged samples held outside a backend at its snapshot moment: payloads back to back.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QueuedSamples {
    payload_size: usize,
    /// Every payload, back to back.
    pub payloads: Vec<u8>,
    /// The priority each sample was sent with (wire v2), `None` for the insert's default.
    pub priorities: Vec<Option<f64>>,
    /// The stream each sample is a step of and whether it ends its episode (a sequence
    /// table's; the default tag for samples of other backends).
    pub steps: Vec<StepTag>,
    /// Taken at the same moment: how far each durable session's samples reach.
    pub sessions: Vec<SessionMark>,
}

impl QueuedSamples {
    /// No samples of `payload_size` bytes yet.
    pub fn new(payload_size: usize) -> Self {
        Self {
            payload_size,
            payloads: Vec::new(),
            priorities: Vec::new(),
            steps: Vec::new(),
            sessions: Vec::new(),
        }
    }

    /// Appends one sample that is a step of `step.stream`.
    ///
    /// # Panics
    /// If `payload` is not `payload_size` bytes.
    pub fn push_step(&mut self, payload: &[u8], priority: Option<f64>, step: StepTag) {
        assert_eq!(payload.len(), self.payload_size, "a queued sample's payload size");
        self.payloads.extend_from_slice(payload);
        self.priorities.push(priority);
        self.steps.push(step);
    }

    /// Appends one sample.
    ///
    /// # Panics
    /// If `payload` is not `payload_size` bytes.
    pub fn push(&mut self, payload: &[u8], priority: Option<f64>) {
        self.push_step(payload, priority, StepTag::default());
    }

    /// How many samples.
    pub fn len(&self) -> usize {
        self.priorities.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.priorities.is_empty()
    }

    /// Payload `i`.
    pub fn payload(&self, i: usize) -> &[u8] {
        &self.payloads[i * self.payload_size..(i + 1) * self.payload_size]
    }
}
