"""Timeouts, close() and what it releases, and the errors a closed server gives."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from _blocked import blocked
from conftest import assert_blocked, take

import echo

# Bound on any single blocking step before it counts as a hang.
WAIT_S = 10.0


# --- timeouts --------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [0, 0.0, 0.05])
def test_sample_with_timeout_raises_timeout_error_when_no_batch_is_ready(
    make_server: Any, make_sample: Any, timeout: float
) -> None:
    server = make_server(batch_size=2)
    server.submit(make_sample(0))  # half a batch is not a batch
    with pytest.raises(TimeoutError, match="timeout"):
        server.sample(timeout=timeout)


def test_timed_out_sample_loses_nothing(make_server: Any, make_sample: Any, batch_ids: Any) -> None:
    server = make_server(batch_size=3)
    server.submit(make_sample(0))
    for _ in range(3):
        with pytest.raises(TimeoutError):
            server.sample(timeout=0.01)
    server.submit(make_sample(1))
    server.submit(make_sample(2))
    sample = server.sample(timeout=0)
    assert sample is not None
    assert batch_ids(sample.batch) == [0, 1, 2]
    assert sample.info.sequence == 0


@pytest.mark.parametrize(
    "timeout", [-1, -0.001, float("nan"), float("-inf")], ids=["-1", "-1ms", "nan", "-inf"]
)
def test_sample_with_negative_or_nan_timeout_is_a_value_error(
    make_server: Any, make_sample: Any, batch_ids: Any, timeout: float
) -> None:
    server = make_server(batch_size=1)
    server.submit(make_sample(4))
    with pytest.raises(ValueError, match="timeout"):
        server.sample(timeout=timeout)
    # The batch was not consumed by the rejected call.
    sample = server.sample(timeout=WAIT_S)
    assert sample is not None
    assert batch_ids(sample.batch) == [4]


def test_submit_with_timeout_raises_timeout_error_while_the_ring_is_full(
    make_filled: Any, make_sample: Any, batch_ids: Any
) -> None:
    server = make_filled(4, batch_size=2, num_buffers=2)
    for timeout in (0, 0.05):
        with pytest.raises(TimeoutError):
            server.submit(make_sample(99), timeout=timeout)
    seen = [*batch_ids(take(server).batch), *batch_ids(take(server).batch)]
    assert seen == [0, 1, 2, 3]
    # The held batch goes back on the next sample(); until then one batch of space is free.
    server.submit(make_sample(4), timeout=0)
    server.submit(make_sample(5), timeout=0)
    assert batch_ids(take(server).batch) == [4, 5]


# --- close() ---------------------------------------------------------------------------------


def test_close_is_idempotent(make_server: Any) -> None:
    server = make_server()
    assert not server.closed
    server.close()
    server.close()
    assert server.closed
    server.close()
    assert server.closed


def test_sample_returns_none_after_close(make_server: Any, make_sample: Any) -> None:
    server = make_server(batch_size=2)
    server.close()
    assert server.sample() is None
    assert server.sample(timeout=0) is None
    assert server.sample(timeout=0.05) is None
    assert server.sample(copy=True) is None


def test_sample_returns_none_after_close_even_with_a_full_batch_committed(
    make_filled: Any,
) -> None:
    server = make_filled(2, batch_size=2)
    server.close()
    assert server.sample(timeout=WAIT_S) is None


def test_dataset_iter_ends_after_close(make_server: Any, make_sample: Any) -> None:
    server = make_server(batch_size=1)
    server.close()
    assert list(server.dataset_iter()) == []
    assert list(server.dataset_iter(copy=True)) == []


def test_close_from_another_thread_unblocks_a_blocked_sample(make_server: Any, spawn: Any) -> None:
    server = make_server(batch_size=2)
    waiter = spawn(server.sample)
    assert_blocked(waiter, blocked(server, "sample"), "sample()")
    server.close()
    assert waiter.finish() is None


def test_close_from_another_thread_ends_dataset_iter(
    make_server: Any, make_sample: Any, batch_ids: Any, spawn: Any
) -> None:
    server = make_server(batch_size=2)
    first_batch_seen = threading.Event()

    def iterate() -> list[list[int]]:
        out = []
        for sample in server.dataset_iter():
            out.append(batch_ids(sample.batch))
            first_batch_seen.set()
        return out

    waiter = spawn(iterate)
    server.submit(make_sample(0))
    server.submit(make_sample(1))
    assert first_batch_seen.wait(WAIT_S)
    assert_blocked(waiter, blocked(server, "sample"), "dataset_iter()")
    server.close()
    assert waiter.finish() == [[0, 1]]


def test_close_unblocks_every_thread_blocked_in_sample(make_server: Any, spawn: Any) -> None:
    server = make_server(batch_size=2)
    waiters = [spawn(server.sample) for _ in range(3)]
    # One waits in the core, the others for their turn at the consumer.
    probe = blocked(server, "sample")
    for waiter in waiters:
        assert_blocked(waiter, probe, "sample()")
    server.close()
    assert [w.finish() for w in waiters] == [None, None, None]


def test_close_releases_a_submit_blocked_on_a_full_ring(
    make_filled: Any, make_sample: Any, spawn: Any
) -> None:
    server = make_filled(4, batch_size=2, num_buffers=2)
    submitter = spawn(server.submit, make_sample(4))
    assert_blocked(submitter, blocked(server, "submit"), "submit()")
    server.close()
    with pytest.raises(echo.ServerClosedError, match="closed"):
        submitter.finish()


def test_close_releases_several_submits_blocked_on_a_full_ring(
    make_filled: Any, make_sample: Any, spawn: Any
) -> None:
    server = make_filled(2, batch_size=1, num_buffers=2)
    submitters = [spawn(server.submit, make_sample(i)) for i in range(2, 5)]
    probe = blocked(server, "submit", count=3)
    for worker in submitters:
        assert_blocked(worker, probe, "submit()")
    server.close()
    for worker in submitters:
        with pytest.raises(echo.ServerClosedError):
            worker.finish()


def test_server_closed_error_is_a_runtime_error() -> None:
    assert issubclass(echo.ServerClosedError, RuntimeError)


def test_submit_after_close_raises_server_closed_error(make_server: Any, make_sample: Any) -> None:
    server = make_server()
    server.close()
    with pytest.raises(echo.ServerClosedError, match="closed"):
        server.submit(make_sample(0))
    with pytest.raises(echo.ServerClosedError):
        server.submit(make_sample(0), timeout=0)


def test_start_after_close_raises_server_closed_error(make_server: Any) -> None:
    server = make_server()
    server.start()
    server.start()  # idempotent while open
    server.close()
    with pytest.raises(echo.ServerClosedError, match="closed"):
        server.start()


def test_context_manager_starts_and_closes(make_server: Any, make_sample: Any) -> None:
    server = make_server(batch_size=1)
    with server as entered:
        assert entered is server
        server.submit(make_sample(1))
        assert server.sample(timeout=WAIT_S) is not None
    assert server.closed
    assert server.sample(timeout=0) is None


def test_views_stay_readable_after_close(make_server: Any, make_sample: Any) -> None:
    server = make_server(batch_size=2)
    server.submit(make_sample(5))
    server.submit(make_sample(6))
    sample = server.sample(timeout=WAIT_S)
    assert sample is not None
    server.close()
    np.testing.assert_array_equal(sample.batch["id"], [5, 6])
    np.testing.assert_array_equal(sample.batch["obs"][1], [6, 6, 6])


# --- copies ----------------------------------------------------------------------------------


def test_dataset_iter_copies_keep_their_values_after_the_ring_is_overwritten(
    make_server: Any, make_sample: Any, batch_ids: Any, spawn: Any
) -> None:
    batch_size, num_batches = 3, 5
    server = make_server(batch_size=batch_size, num_buffers=2)
    producer = spawn(
        lambda: [
            server.submit(make_sample(i), timeout=WAIT_S) for i in range(num_batches * batch_size)
        ]
    )
    kept = []
    for sample in server.dataset_iter(copy=True):
        kept.append(sample)
        if len(kept) == num_batches:
            break
    producer.finish()
    # Laps the 2-batch ring again, so every slot the kept batches came from is rewritten.
    more = spawn(
        lambda: [server.submit(make_sample(-1 - i), timeout=WAIT_S) for i in range(2 * batch_size)]
    )
    for _ in range(2):
        assert server.sample(timeout=WAIT_S) is not None
    more.finish()
    for n, sample in enumerate(kept):
        assert batch_ids(sample.batch) == list(range(n * batch_size, (n + 1) * batch_size))
        assert sample.info.sequence == n


def test_copies_are_writeable_private_arrays(make_server: Any, make_sample: Any) -> None:
    server = make_server(batch_size=2)
    for i in range(4):
        server.submit(make_sample(i))
    first = server.sample(timeout=WAIT_S, copy=True)
    second = server.sample(timeout=WAIT_S, copy=True)
    assert first is not None
    assert second is not None
    for name, leaf in first.batch.items():
        assert isinstance(leaf, np.ndarray)
        assert leaf.flags.writeable
        assert leaf.flags.c_contiguous
        assert leaf.shape[0] == 2
        assert not np.shares_memory(leaf, second.batch[name])
    first.batch["id"][:] = 42
    first.batch["obs"] += 1
    np.testing.assert_array_equal(first.batch["id"], [42, 42])
    np.testing.assert_array_equal(first.batch["obs"], [[1, 1, 1], [2, 2, 2]])
    np.testing.assert_array_equal(second.batch["id"], [2, 3])


def test_held_copies_never_share_memory_and_dropped_ones_are_reused(
    make_server: Any, make_sample: Any, batch_ids: Any
) -> None:
    """A copy's leaves live in buffers that go back to the server's pool only once every
    array over them is collected: batches still held keep their values through many more
    copies, and a dropped batch's memory is what the next copy gets (no fresh pages)."""
    server = make_server(batch_size=2, num_buffers=4)
    held = []
    for n in range(12):
        server.submit(make_sample(2 * n))
        server.submit(make_sample(2 * n + 1))
        sample = server.sample(timeout=WAIT_S, copy=True)
        assert sample is not None
        if n % 3 == 0:
            held.append((n, sample))  # kept: its buffers must not be handed out again
        assert type(sample.batch["obs"].base).__name__ == "BatchCopy"
    del sample
    addresses = [kept.batch["obs"].ctypes.data for _, kept in held]
    assert len(set(addresses)) == len(held)
    for n, kept in held:
        assert batch_ids(kept.batch) == [2 * n, 2 * n + 1]
        np.testing.assert_array_equal(kept.batch["obs"][1], [2 * n + 1] * 3)
    del kept
    # Drop one batch (and with it its arrays' last references): the next copy reuses it.
    freed = held.pop()[1].batch["obs"].ctypes.data
    server.submit(make_sample(100))
    server.submit(make_sample(101))
    again = server.sample(timeout=WAIT_S, copy=True)
    assert again is not None
    assert again.batch["obs"].ctypes.data == freed
    assert batch_ids(again.batch) == [100, 101]
    # A view of a copy keeps its buffer: the base chain ends at the BatchCopy.
    view = again.batch["obs"][1:]
    del again
    server.submit(make_sample(102))
    server.submit(make_sample(103))
    other = server.sample(timeout=WAIT_S, copy=True)
    assert other is not None
    assert other.batch["obs"].ctypes.data != freed
    np.testing.assert_array_equal(view, [[101, 101, 101]])
    server.close()


def test_default_views_are_only_meaningful_until_the_next_sample(
    make_filled: Any, make_sample: Any, batch_ids: Any
) -> None:
    # Documentation, not a guarantee either way: a view of an earlier batch may show newer
    # samples once its slots were given back and rewritten. Only its shape, dtype and
    # read-only flag are stable; copy=True (or np.copy) keeps values.
    server = make_filled(4, batch_size=2, num_buffers=2)
    old = take(server)
    kept = np.copy(old.batch["id"])
    take(server)
    server.submit(make_sample(10))
    server.submit(make_sample(11))
    assert old.batch["id"].shape == (2,)
    assert not old.batch["id"].flags.writeable
    assert kept.tolist() == [0, 1]
