//! Strategies behind the consumer: which committed batch it gets next ([`Sampler`]) and which
//! slots go back to the writers once it is done with one ([`Remover`]).
//!
//! The store's reservation protocol needs exactly one thing from them: the read cursor that a
//! remover returns grows monotonically and in whole batches, so a reservation (which never
//! crosses a batch boundary) is either entirely free or entirely busy. [`Fifo`] hands batches
//! out in commit-slot order and frees each as soon as it is given back, so every sample is
//! seen exactly once, in the order it was reserved.

/// Chooses the batch the consumer receives next.
pub trait Sampler: Send + 'static {
    /// Absolute index of the batch to hand out next.
    fn next_batch(&self) -> u64;
    /// `batch` (the value `next_batch` returned) has been handed to the consumer.
    fn on_sampled(&mut self, batch: u64);
}

/// Chooses which slots become writable again.
pub trait Remover: Send + 'static {
    /// The consumer gave `batch` back. Returns the new read cursor: the absolute slot index below
    /// which every slot may be rewritten. Must be a multiple of `batch_size` and never decrease.
    fn on_released(&mut self, batch: u64, batch_size: usize) -> u64;
}

/// First in, first out: batch `0`, `1`, `2`, ... each handed out once and freed on release.
#[derive(Debug, Default, Clone)]
pub struct Fifo {
    next: u64,
}

impl Sampler for Fifo {
    fn next_batch(&self) -> u64 {
        self.next
    }

    fn on_sampled(&mut self, batch: u64) {
        debug_assert_eq!(batch, self.next, "FIFO hands out batches in order");
        self.next = batch + 1;
    }
}

impl Remover for Fifo {
    fn on_released(&mut self, batch: u64, batch_size: usize) -> u64 {
        (batch + 1) * batch_size as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_hands_out_batches_in_order_and_frees_whole_batches() {
        let mut fifo = Fifo::default();
        for expected in 0..5 {
            let batch = fifo.next_batch();
            assert_eq!(batch, expected);
            fifo.on_sampled(batch);
            assert_eq!(Remover::on_released(&mut fifo, batch, 32), (expected + 1) * 32);
        }
    }
}
