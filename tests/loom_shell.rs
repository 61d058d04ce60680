//! loom models of the table shell's wait/close protocol (`src/replay/shell.rs`): writers park
//! on the shell until the table lets them in, the consumer until it may draw, and `close`
//! wakes both for good.
//!
//! Run with `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test --release --test
//! loom_shell --target-dir target/loom`. The `Shell` is the real code both replay tables
//! embed, on loom's atomics, mutex and condvars; only the table's state is a stand-in (a
//! flag or a count behind the same kind of lock). Under loom a wait has no deadline, so a lost
//! wake-up leaves a thread parked for good and loom reports a deadlock.
#![cfg(loom)]

use loom::sync::Arc;
use loom::thread;

use echo::error::EchoError;
use echo::replay::shell::{Parked, Shell, Side, WaitState};
use echo::sync::Mutex;

/// A table's locked state, reduced to what the waits look at.
#[derive(Default)]
struct State {
    parked: Parked,
    /// Whether an insert may go on (the rate limiter's answer, room).
    room: bool,
    /// Items the consumer may draw.
    items: u32,
}

impl WaitState for State {
    fn parked(&mut self) -> &mut Parked {
        &mut self.parked
    }

    fn add_blocked_ns(&mut self, _side: Side, _ns: u64) {}
}

/// A table: its lock and its shell.
struct Table {
    state: Mutex<State>,
    shell: Shell,
}

impl Table {
    fn new() -> Arc<Self> {
        Arc::new(Self { state: Mutex::new(State::default()), shell: Shell::new() })
    }
}

/// A writer's wait, as the tables' `insert` makes it.
fn insert(table: &Table) -> Result<(), EchoError> {
    let mut state = table.state.lock();
    table.shell.wait_writable(&mut state, None, |s| s.room)
}

/// The consumer's wait, as `Shell::draw_rounds` makes it: closed first, then items, else park.
fn sample(table: &Table) -> Result<(), EchoError> {
    let mut state = table.state.lock();
    loop {
        if table.shell.is_closed() {
            return Err(EchoError::Closed);
        }
        if state.items > 0 {
            state.items -= 1;
            return Ok(());
        }
        table.shell.park_consumer(&mut state, None);
    }
}

#[test]
fn close_wakes_a_parked_writer_and_consumer() {
    loom::model(|| {
        let table = Table::new();
        let writer = {
            let table = Arc::clone(&table);
            thread::spawn(move || insert(&table))
        };
        let consumer = {
            let table = Arc::clone(&table);
            thread::spawn(move || sample(&table))
        };
        table.shell.close(&table.state.lock());
        assert!(matches!(writer.join().unwrap(), Err(EchoError::Closed)));
        assert!(matches!(consumer.join().unwrap(), Err(EchoError::Closed)));
        let state = table.state.lock();
        assert_eq!(state.parked, Parked::default(), "nobody counted as parked after leaving");
    });
}

/// The notifier makes room under the lock and wakes the writers after letting it go (as
/// `end_restore` does): the writer either sees the room at its check or is parked when the
/// wake comes.
#[test]
fn room_made_before_a_wake_after_the_lock_is_never_missed() {
    loom::model(|| {
        let table = Table::new();
        let writer = {
            let table = Arc::clone(&table);
            thread::spawn(move || insert(&table))
        };
        table.state.lock().room = true;
        table.shell.wake_writers();
        assert!(writer.join().unwrap().is_ok());
    });
}

/// A writer publishes under the lock and notifies the consumer there (as `publish` does),
/// while the table closes: the consumer gets the item or the close, never neither.
#[test]
fn a_publish_or_a_close_always_reaches_the_parked_consumer() {
    loom::model(|| {
        let table = Table::new();
        let consumer = {
            let table = Arc::clone(&table);
            thread::spawn(move || sample(&table))
        };
        let publisher = {
            let table = Arc::clone(&table);
            thread::spawn(move || {
                let mut state = table.state.lock();
                state.items += 1;
                table.shell.notify_sample();
            })
        };
        table.shell.close(&table.state.lock());
        publisher.join().unwrap();
        let got = consumer.join().unwrap();
        assert!(matches!(got, Ok(()) | Err(EchoError::Closed)));
    });
}
