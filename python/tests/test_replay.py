"""Replay servers (`sampler=` anything but `Fifo()`): argument validation with precise
exceptions, batches with keys/probabilities/times_sampled, priority updates, removers, rate
limiters (blocking, timeouts, close), the view lifetime, and TCP workers feeding a table.

The heavy statistics (chi-square over 10^5 draws for every sampler) live in
`tests/replay.rs`; here the Python surface is checked end to end.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import WAIT_S, Worker, poll

import echo

REPLAY = {"sampler": echo.Uniform(), "max_size": 16}


def _ids(batch: Any) -> list[int]:
    return [int(i) for i in batch["id"]]


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: echo.Prioritized(-0.5),
            ValueError,
            "exponent must be a finite number >= 0, got -0.5",
        ),
        (
            lambda: echo.Prioritized(float("nan")),
            ValueError,
            "exponent must be a finite number >= 0",
        ),
        (
            lambda: echo.Prioritized("0.6"),
            TypeError,
            r"Prioritized\(exponent\) must be a number, got str",
        ),  # type: ignore[arg-type]
        (lambda: echo.MinSize(0), ValueError, r"MinSize\(min_size\) must be >= 1, got 0"),
        (lambda: echo.MinSize(2.5), TypeError, r"MinSize\(min_size\) must be an int, got float"),  # type: ignore[arg-type]
        (lambda: echo.Queue(0), ValueError, r"Queue\(size\) must be >= 1, got 0"),
        (
            lambda: echo.SampleToInsertRatio(0.0, 10, 5.0),
            ValueError,
            "samples_per_insert must be a finite number > 0, got 0.0",
        ),
        (
            lambda: echo.SampleToInsertRatio(-1.0, 10, 5.0),
            ValueError,
            "samples_per_insert must be a finite number > 0, got -1.0",
        ),
        (
            lambda: echo.SampleToInsertRatio(8.0, 10, 7.0),
            ValueError,
            r"error_buffer >= 8.0\), got 7.0",
        ),
        (
            lambda: echo.SampleToInsertRatio(1.0, 10, (5.0, 6.0)),
            ValueError,
            r"must span at least 2 \* max\(1, samples_per_insert\) = 2.0",
        ),
        (
            lambda: echo.SampleToInsertRatio(1.0, 0, 5.0),
            ValueError,
            r"min_size_to_sample\) must be >= 1, got 0",
        ),
    ],
)
def test_bad_strategy_parameters_raise_precise_errors(
    make: Callable[[], object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"sampler": echo.Uniform()}, ValueError, "max_size is required with sampler=Uniform()"),
        ({"sampler": echo.Uniform(), "max_size": 3}, ValueError, r"max_size must be >= 4, got 3"),
        ({"sampler": "uniform", "max_size": 8}, TypeError, r"sampler must be Fifo\(\), .* got str"),
        (
            {"sampler": echo.Uniform(), "max_size": 8, "remover": echo.Uniform()},
            TypeError,
            r"remover must be Fifo\(\), Lifo\(\) or MinPriority\(\), got Uniform",
        ),
        (
            {"sampler": echo.Uniform(), "max_size": 8, "rate_limiter": 3},
            TypeError,
            "rate_limiter must be MinSize",
        ),
        (
            {"sampler": echo.Uniform(), "max_size": 8, "rate_limiter": echo.MinSize(9)},
            ValueError,
            r"min_size must be in 1..=max_size \(8\), got 9",
        ),
        (
            {"sampler": echo.Uniform(), "max_size": 8, "max_times_sampled": -1},
            ValueError,
            r"max_times_sampled must be in \[0, 4294967295\], got -1",
        ),
        ({"sampler": echo.Uniform(), "max_size": 8, "seed": -2}, ValueError, "seed must be in"),
        ({"rate_limiter": echo.MinSize(2)}, ValueError, "needs a replay sampler"),
        ({"remover": echo.Lifo()}, ValueError, r"remover=Lifo\(\) needs a replay sampler"),
        ({"max_size": 100}, ValueError, "max_size needs a replay sampler"),
        ({"max_times_sampled": 2}, ValueError, "max_times_sampled=2 needs a replay sampler"),
        ({"seed": 1}, ValueError, "seed needs a replay sampler"),
    ],
)
def test_bad_server_arguments_raise_precise_errors(
    example: dict[str, np.ndarray], kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        echo.Server(example, 4, **kwargs)


def test_a_fifo_queue_rate_limiter_sizes_the_ring(make_server: Any) -> None:
    assert make_server(batch_size=4, rate_limiter=echo.Queue(10)).num_buffers == 3
    assert make_server(batch_size=4, rate_limiter=echo.Queue(1)).num_buffers == 2
    fifo = make_server(batch_size=4, sampler=echo.Fifo(), remover=echo.Fifo(), max_times_sampled=1)
    assert (fifo.num_buffers, fifo.max_size) == (3, None)


def test_fifo_servers_refuse_priorities(make_server: Any, make_sample: Any) -> None:
    server = make_server()
    with pytest.raises(ValueError, match="priority= needs a replay sampler; this server is FIFO"):
        server.submit(make_sample(0), priority=1.0)
    with pytest.raises(ValueError, match="update_priorities\\(\\) needs a replay sampler"):
        server.update_priorities([0], [1.0])


@pytest.mark.parametrize(
    ("keys", "priorities", "error", "message"),
    [
        ([0.5, 1.0], [1.0, 1.0], TypeError, "keys must be integers .* got dtype float64"),
        (["a"], [1.0], TypeError, "keys must be integers"),
        ([[0, 1]], [1.0, 1.0], ValueError, r"keys must be 1-D, got shape \(1, 2\)"),
        ([0, -3], [1.0, 1.0], ValueError, "keys must be >= 0, got -3"),
        ([0, 1], ["x", "y"], TypeError, "priorities must be real numbers"),
        ([0, 1], [1.0], ValueError, "got 2 keys and 1 priorities"),
        (
            [0, 1],
            [1.0, float("nan")],
            ValueError,
            r"priorities\[1\] must be a finite number >= 0, got NaN",
        ),
        ([0, 1], [-1.0, 1.0], ValueError, r"priorities\[0\] must be a finite number >= 0, got -1"),
        ([0], [1e300], ValueError, r"priorities\[0\] must be at most 1e250"),
    ],
)
def test_bad_priority_updates_raise_precise_errors_and_change_nothing(
    make_server: Any,
    make_sample: Any,
    keys: Any,
    priorities: Any,
    error: type[Exception],
    message: str,
) -> None:
    server = make_server(sampler=echo.Prioritized(), max_size=8)
    server.submit(make_sample(0), priority=2.0)
    server.submit(make_sample(1), priority=3.0)
    with pytest.raises(error, match=message):
        server.update_priorities(keys, priorities)
    assert (server._core.priority(0), server._core.priority(1)) == (2.0, 3.0)


def test_a_bad_submit_priority_is_a_value_error(make_server: Any, make_sample: Any) -> None:
    server = make_server(sampler=echo.Prioritized(2.0), max_size=8)
    with pytest.raises(ValueError, match="priority must be a finite number >= 0, got -1"):
        server.submit(make_sample(0), priority=-1.0)
    with pytest.raises(
        ValueError, match=r"priority is too large: 1e200 \*\* exponent 2 = inf exceeds"
    ):
        server.submit(make_sample(0), priority=1e200)
    assert server.stats().store_size == 0


# --- batches --------------------------------------------------------------------------------


def test_a_replay_batch_has_the_structure_and_per_item_arrays(make_server: Any) -> None:
    example = {"obs": {"pixels": np.zeros((2, 2), np.uint8)}, "id": np.zeros((), np.int64)}
    server = make_server(example, batch_size=8, sampler=echo.Uniform(), max_size=8, seed=3)
    for i in range(4):
        server.submit({"obs": {"pixels": np.full((2, 2), i, np.uint8)}, "id": np.int64(i)})
    got = server.sample(timeout=WAIT_S)
    assert isinstance(got, echo.Sample)
    batch, info = got  # still a named tuple (batch, info)
    ids = [int(i) for i in batch["id"]]
    assert set(ids) <= {0, 1, 2, 3}
    np.testing.assert_array_equal(batch["obs"]["pixels"][:, 0, 0], ids)
    assert got.keys is not None
    assert got.probabilities is not None
    assert got.times_sampled is not None
    assert (got.keys.dtype, got.probabilities.dtype, got.times_sampled.dtype) == (
        np.uint64,
        np.float64,
        np.uint32,
    )
    np.testing.assert_array_equal(got.keys, ids)  # keys are insertion numbers
    np.testing.assert_array_equal(got.probabilities, np.full(8, 0.25))
    for leaf in (batch["id"], batch["obs"]["pixels"], got.keys):
        assert not leaf.flags.writeable
    assert info.items_sampled_total == 8
    assert info.notify_count == 1
    assert info.store_size == 4
    copied = server.sample(timeout=WAIT_S, copy=True)
    assert copied is not None
    assert copied.keys is not None
    assert copied.batch["id"].flags.writeable
    assert copied.keys.flags.writeable


def test_a_batch_stays_intact_through_the_next_sample(make_server: Any, make_sample: Any) -> None:
    server = make_server(batch_size=2, sampler=echo.Lifo(), max_size=8, max_times_sampled=1)
    for i in range(6):
        server.submit(make_sample(i))
    first = server.sample(timeout=WAIT_S)
    second = server.sample(timeout=WAIT_S)
    assert first is not None
    assert second is not None
    assert (_ids(first.batch), _ids(second.batch)) == ([5, 4], [3, 2])
    third = server.sample(timeout=WAIT_S)
    assert third is not None
    assert _ids(third.batch) == [1, 0]
    # The third batch reuses the first one's half of the double-buffered batch area.
    assert _ids(first.batch) == [1, 0]


def test_views_outlive_the_server(make_sample: Any, example: dict[str, np.ndarray]) -> None:
    server = echo.Server(example, 2, sampler=echo.Uniform(), max_size=2)
    for _ in range(2):
        server.submit(make_sample(7))
    got = server.sample(timeout=WAIT_S)
    assert got is not None
    ids = got.batch["id"]
    server.close()
    del server, got
    gc.collect()
    assert _ids({"id": ids}) == [7, 7]


def test_update_priorities_steers_the_next_batch_and_counts_unknown_keys(
    make_server: Any, make_sample: Any
) -> None:
    server = make_server(batch_size=16, sampler=echo.Prioritized(1.0), max_size=16, seed=5)
    for i in range(10):
        server.submit(make_sample(i))
    got = server.sample(timeout=WAIT_S)
    assert got is not None
    assert got.keys is not None
    priorities = np.zeros(10)
    priorities[3] = 1.0
    skipped = server.update_priorities(np.arange(10), priorities)
    assert skipped == 0
    got = server.sample(timeout=WAIT_S)
    assert got is not None
    assert _ids(got.batch) == [3] * 16
    assert got.probabilities is not None
    assert np.all(got.probabilities == 1.0)
    assert server.update_priorities(np.array([3, 99, 100], np.uint64), [1.0, 1.0, 1.0]) == 2
    info = server.stats()
    assert (info.priority_updates_total, info.unknown_keys_total) == (11, 2)


def test_new_items_get_the_largest_priority_seen(make_server: Any, make_sample: Any) -> None:
    server = make_server(sampler=echo.Prioritized(), max_size=8)
    server.submit(make_sample(0))
    assert server._core.priority(0) == 1.0
    server.update_priorities([0], [7.5])
    server.submit(make_sample(1))
    server.submit(make_sample(2), priority=0.25)
    assert (server._core.priority(1), server._core.priority(2)) == (7.5, 0.25)


def test_prioritized_draws_follow_priority_to_the_exponent(
    make_server: Any, make_sample: Any
) -> None:
    exponent = 0.5
    server = make_server(batch_size=64, sampler=echo.Prioritized(exponent), max_size=64, seed=9)
    priorities = np.array([1.0, 4.0, 16.0, 64.0])
    for i, p in enumerate(priorities):
        server.submit(make_sample(i), priority=float(p))
    counts = np.zeros(4)
    for _ in range(400):
        got = server.sample(timeout=WAIT_S)
        assert got is not None
        counts += np.bincount(got.batch["id"], minlength=4)
    expected = priorities**exponent / np.sum(priorities**exponent) * counts.sum()
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 16.3, (counts, expected)  # 3 degrees of freedom, 0.1% critical value


@pytest.mark.parametrize(
    ("remover", "priorities", "left"),
    [
        (echo.Fifo(), [1, 1, 1, 1, 1], [2, 3, 4]),
        (echo.Lifo(), [1, 1, 1, 1, 1], [0, 1, 4]),
        (echo.MinPriority(), [5, 1, 4, 2, 3], [0, 2, 4]),
    ],
)
def test_each_remover_evicts_the_right_item(
    make_server: Any, make_sample: Any, remover: Any, priorities: list[float], left: list[int]
) -> None:
    server = make_server(batch_size=3, sampler=echo.Lifo(), remover=remover, max_size=3)
    for i, p in enumerate(priorities):
        server.submit(make_sample(i), priority=float(p))
    assert server.stats().evicted_total == 2
    got = server.sample(timeout=WAIT_S)
    assert got is not None
    assert sorted(_ids(got.batch)) == left


def test_max_times_sampled_removes_an_item_after_exactly_k_draws(
    make_server: Any, make_sample: Any
) -> None:
    server = make_server(
        batch_size=5, sampler=echo.Uniform(), max_size=10, max_times_sampled=2, seed=2
    )
    for i in range(10):
        server.submit(make_sample(i))
    counts = np.zeros(10, int)
    for _ in range(4):
        got = server.sample(timeout=WAIT_S)
        assert got is not None
        assert got.times_sampled is not None
        counts += np.bincount(got.batch["id"], minlength=10)
        assert np.all(got.times_sampled <= 2)
    assert list(counts) == [2] * 10
    assert server.stats().removed_max_times_sampled_total == 10
    with pytest.raises(TimeoutError, match="sample\\(\\): no full batch"):
        server.sample(timeout=0.05)


# --- rate limiting, blocking, close ---------------------------------------------------------


def _rate_limited(
    make_server: Any, make_sample: Any, batch_size: int, limiter: Any, items: int
) -> echo.Server:
    """A uniform replay server of 8 items paced by `limiter`, holding `items` samples."""
    server = make_server(
        batch_size=batch_size, sampler=echo.Uniform(), max_size=8, rate_limiter=limiter
    )
    for i in range(items):
        server.submit(make_sample(i))
    return server


# A blocked `sample()`/`submit()` waits in slices of at most 50 ms (so Ctrl-C works); each
# slice that ends without progress adds its wait to `sample_blocked_ns_total` /
# `insert_blocked_ns_total`. So a counter that grew while nothing could unblock the call shows,
# without sleeping, that the call is blocked (not merely slow to start), and how long it was.


def _time_out_then_block(
    server: echo.Server,
    field: str,
    time_out: Callable[[], Any],
    block: Callable[[], Any],
    at_least_ns: int,
    spawn: Callable[..., Worker],
) -> Worker:
    """Runs `time_out()` (a call that must time out), then `block()` in a worker, and checks
    that `stats().<field>` counts both waits: the timed-out one, and at least `at_least_ns` of
    the blocked one while it still runs; never more than the time that passed. Returns the
    worker, still blocked."""
    started = time.monotonic()
    time_out()
    timed_out = getattr(server.stats(), field)
    assert 0 < timed_out <= (time.monotonic() - started) * 1e9
    worker = spawn(block)
    poll(
        server.stats,
        lambda s: getattr(s, field) >= timed_out + at_least_ns,
        f"the blocked call counted in {field}",
    )
    assert worker.is_alive(), f"the call returned while it could not proceed: {worker.error!r}"
    assert getattr(server.stats(), field) <= (time.monotonic() - started) * 1e9
    return worker


def test_min_size_blocks_sampling_and_the_wait_shows_in_metrics(
    make_server: Any, make_sample: Any, spawn: Any
) -> None:
    server = _rate_limited(make_server, make_sample, 2, echo.MinSize(3), items=2)

    def time_out() -> None:
        with pytest.raises(TimeoutError):
            server.sample(timeout=0.1)

    field = "sample_blocked_ns_total"
    block = functools.partial(server.sample, timeout=WAIT_S)
    waiter = _time_out_then_block(server, field, time_out, block, 50_000_000, spawn)
    server.submit(make_sample(2))
    assert waiter.finish() is not None


def test_a_queue_blocks_inserts_until_a_sample_frees_room(
    make_server: Any, make_sample: Any, spawn: Any
) -> None:
    server = _rate_limited(make_server, make_sample, 1, echo.Queue(2), items=2)
    started = time.monotonic()

    def time_out() -> None:
        with pytest.raises(TimeoutError, match="submit\\(\\): timed out"):
            server.submit(make_sample(2), timeout=0.05)

    field = "insert_blocked_ns_total"
    block = functools.partial(server.submit, make_sample(3), timeout=WAIT_S)
    worker = _time_out_then_block(server, field, time_out, block, 100_000_000, spawn)
    assert server.sample(timeout=WAIT_S) is not None
    worker.finish()
    blocked = server.stats().insert_blocked_ns_total
    assert 100_000_000 <= blocked <= (time.monotonic() - started) * 1e9


def test_close_wakes_blocked_sample_and_submit(
    make_server: Any, make_sample: Any, spawn: Any
) -> None:
    sampler = make_server(batch_size=2, sampler=echo.Uniform(), max_size=8)
    inserter = _rate_limited(make_server, make_sample, 1, echo.Queue(1), items=1)
    waiting_sample = spawn(sampler.sample)
    waiting_submit = spawn(inserter.submit, make_sample(1))
    poll(sampler.stats, lambda s: s.sample_blocked_ns_total > 0, "sample() blocking")
    poll(inserter.stats, lambda s: s.insert_blocked_ns_total > 0, "submit() blocking")
    assert waiting_sample.is_alive(), "sample() returned from an empty table"
    assert waiting_submit.is_alive(), "submit() returned with Queue(1) full"
    sampler.close()
    inserter.close()
    assert waiting_sample.finish() is None
    with pytest.raises(echo.ServerClosedError):
        waiting_submit.finish()


def test_sample_to_insert_ratio_paces_a_concurrent_producer(
    make_server: Any, make_sample: Any
) -> None:
    spi, min_size, buffer = 4.0, 20, 10.0
    server = make_server(
        batch_size=8,
        sampler=echo.Uniform(),
        max_size=1_000,
        rate_limiter=echo.SampleToInsertRatio(spi, min_size, buffer),
    )
    inserts = 400

    def produce() -> None:
        for i in range(inserts):
            server.submit(make_sample(i), timeout=WAIT_S)

    producer = Worker(produce)
    producer.start()
    sampled = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            got = server.sample(timeout=0.2)
        except TimeoutError:
            if producer.is_alive():  # read after the wait: it may have finished during it
                continue
            break
        assert got is not None
        sampled += 8
        # Samples never outrun inserts: store_size (every insert so far: nothing is evicted)
        # was read after this batch, so it can only be larger than at sampling time.
        assert sampled <= got.info.store_size * spi - (min_size * spi - buffer)
    producer.finish()
    # All 400 inserts allow 400 * 4 - 70 = 1530 samples: 191 batches of 8.
    assert sampled == 191 * 8


# --- TCP ------------------------------------------------------------------------------------


def test_tcp_workers_feed_a_replay_table_exactly_once() -> None:
    example = {"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}
    server = echo.Server(
        example,
        8,
        transport=echo.TcpTransport(port=0),
        sampler=echo.Uniform(),
        max_size=64,
        rate_limiter=echo.Queue(64),
        max_times_sampled=1,
    )
    try:
        server.start()
        assert server.port is not None
        per_worker, workers = 250, 4

        def work(w: int) -> None:
            client = echo.TcpClient("127.0.0.1", server.port or 0, example)
            for i in range(per_worker):
                j = w * per_worker + i
                client.send({"id": np.array(j, np.int64), "obs": np.full(3, j, np.float32)})
            client.close()

        threads = [Worker(work, w) for w in range(workers)]
        for t in threads:
            t.start()
        seen: list[int] = []
        while len(seen) < per_worker * workers:
            got = server.sample(timeout=WAIT_S)
            assert got is not None
            ids = _ids(got.batch)
            np.testing.assert_array_equal(got.batch["obs"][:, 0], ids)
            seen += ids
        for t in threads:
            t.finish()
        assert sorted(seen) == list(range(per_worker * workers))
        # Drainers count a round after inserting it: the counter catches up right after.
        deadline = time.monotonic() + WAIT_S
        while server.stats().samples_inserted_total < per_worker * workers:
            assert time.monotonic() < deadline, server.stats()
            time.sleep(0.01)
        assert server.stats().samples_inserted_total == per_worker * workers
    finally:
        server.close()


def test_update_priorities_converts_dtypes_and_accepts_empty_and_strided_input(
    make_server: Any, make_sample: Any
) -> None:
    server = make_server(sampler=echo.Prioritized(1.0), max_size=8)
    for i in range(4):
        server.submit(make_sample(i))
    assert server.update_priorities(np.array([], np.uint64), np.array([])) == 0
    assert server.update_priorities([], []) == 0
    keys = np.array([0, 9, 1, 9, 2, 9], np.int32)[::2]  # strided int32: 0, 1, 2
    assert server.update_priorities(keys, np.array([1, 2, 3], np.int64)) == 0
    assert server.update_priorities(np.uint8(3).reshape(1), np.float32([0.5])) == 0
    assert [server._core.priority(k) for k in range(4)] == [1.0, 2.0, 3.0, 0.5]
    with pytest.raises(TypeError, match=r"keys must be integers .* got dtype object"):
        server.update_priorities([2**70], [1.0])
