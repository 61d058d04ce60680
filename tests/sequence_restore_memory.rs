//! What a sequence table's restore allocates for the streams a snapshot lists.
//!
//! A stream's state holds the slots of its last `length` steps. A snapshot may list any number
//! of streams (a stream costs 33 bytes in it), so a restore that gave each listed stream that
//! ring would turn a small (or tampered) checkpoint into gigabytes. Only a stream with steps
//! stored in a live chunk of its own needs its ring at once, and those are at most one per
//! chunk; the others take theirs at their next step.
//!
//! The bytes are counted by a global allocator that tallies the allocations of the thread
//! that asks (the restore runs on the caller's thread), so other tests cannot disturb it: it
//! is the only test in this binary anyway.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use echo::replay::{LeafRows, ReplayConfig, SequenceConfig, SequenceTable};
use echo::{ArraySpec, DataSpec, EpisodeEnd, StepLeaves, StepTag};

struct Counting;

thread_local! {
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded unchanged to `System`; the tally is a thread-local `Cell`
// with a const initialiser, which neither allocates nor can be reentered.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.with(|a| a.set(a.get() + layout.size()));
        // SAFETY: the caller's contract for `alloc` is `System.alloc`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.with(|a| a.set(a.get() + layout.size()));
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATED.with(|a| a.set(a.get() + new_size.saturating_sub(layout.size())));
        // SAFETY: the caller's contract for `realloc` is `System.realloc`'s.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` through the methods above, with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocated() -> usize {
    ALLOCATED.with(Cell::get)
}

const LENGTH: usize = 4096;
const STREAMS: u64 = 2000;

fn table() -> Arc<SequenceTable> {
    let spec = DataSpec::new(vec![ArraySpec::new(vec![], 8).unwrap()]).unwrap();
    let config = ReplayConfig { seed: Some(3), ..ReplayConfig::new(2, 1 << 16) };
    SequenceTable::new(spec, config, SequenceConfig::new(LENGTH)).unwrap()
}

#[test]
fn a_restore_gives_rings_only_to_streams_with_steps_stored() {
    let source = table();
    let deadline = || Some(Instant::now() + Duration::from_secs(30));
    // Many streams whose one-step episodes ended (listed, no episode open), and one with an
    // episode still open (ringed: its steps are in its live chunk).
    for stream in 0..STREAMS {
        let id = stream.to_ne_bytes();
        let leaves = [&id[..]];
        let tag = StepTag { stream, end: EpisodeEnd::Terminated };
        source.insert(&StepLeaves(&leaves, tag), None, deadline()).unwrap();
    }
    let open = STREAMS;
    for step in 0..3u64 {
        let id = (open << 20 | step).to_ne_bytes();
        let leaves = [&id[..]];
        let tag = StepTag { stream: open, end: EpisodeEnd::No };
        source.insert(&StepLeaves(&leaves, tag), None, deadline()).unwrap();
    }
    let (mut checkpoint, ()) = source.checkpoint_with(|| ()).unwrap();
    let mut steps = Vec::new();
    let mut out = vec![Vec::new()];
    while checkpoint.next_chunk(1 << 20, &mut out) > 0 {
        steps.extend_from_slice(&out[0]);
    }
    let restored = table();
    let before = allocated();
    restored.restore(checkpoint.snapshot(), &[LeafRows::Raw(&steps)], &[&[]]).unwrap();
    let during = allocated() - before;
    // A ring per listed stream would be STREAMS x LENGTH x 4 bytes (32 MiB); the streams'
    // own state and the maps that find them are well under a tenth of that.
    let rings = STREAMS as usize * LENGTH * 4;
    assert!(
        during < rings / 10,
        "the restore allocated {during} bytes for {STREAMS} listed streams ({rings} with a ring each)"
    );
    assert_eq!(restored.stats().streams_open, 1);

    // A listed stream takes its ring at its next step, and the open one goes on where it was.
    for (stream, index) in [(7, 0u64), (open, 3)] {
        let id = (stream << 20 | index).to_ne_bytes();
        let leaves = [&id[..]];
        let tag = StepTag { stream, end: EpisodeEnd::Terminated };
        restored.insert(&StepLeaves(&leaves, tag), None, deadline()).unwrap();
    }
    assert_eq!(restored.stats().streams_open, 0);
    assert_eq!(restored.stats().episodes_ended, STREAMS + 2);
}
