"""Replay tables of ragged samples at their limits: `max_times_sampled` counted per draw
(within one batch too), an entry that can never fit refused before anything is evicted,
and settings that could never hand out a batch refused when the server is made."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

import echo
from echo import Ragged


def example() -> dict[str, Any]:
    return {"t": Ragged(1024, np.int32), "id": np.zeros((), np.int64)}


def make(i: int, n: int = 3) -> dict[str, Any]:
    return {"t": np.full(n, i, np.int32), "id": np.int64(i)}


SAMPLERS = [echo.Uniform(), echo.Prioritized(1.0)]


@pytest.mark.parametrize("sampler", SAMPLERS, ids=["uniform", "prioritized"])
def test_each_entry_is_drawn_exactly_max_times_sampled_times_even_within_one_batch(
    sampler: Any,
) -> None:
    server = echo.Server(example(), 4, sampler=sampler, max_size=100, max_times_sampled=2)
    for i in range(8):
        server.submit(make(i))
    drawn: list[tuple[int, int]] = []
    for _ in range(4):  # 8 entries x 2 draws: exactly 4 batches of 4
        s = server.sample(timeout=5)
        assert s is not None
        ids = [int(i) for i in s.batch["id"]]
        assert s.batch["t"].values.tolist() == [i for i in ids for _ in range(3)]
        drawn += zip(ids, (int(t) for t in s.times_sampled), strict=True)
    assert Counter(i for i, _ in drawn) == {i: 2 for i in range(8)}
    for i in range(8):  # each draw says which one it was, in order
        assert [t for j, t in drawn if j == i] == [1, 2]
    assert server.stats().store_size == 0
    with pytest.raises(TimeoutError):
        server.sample(timeout=0.2)
    server.close()


def test_repeated_draws_in_one_batch_count_one_by_one() -> None:
    server = echo.Server(example(), 4, sampler=echo.Uniform(), max_size=10)
    server.submit(make(3))
    s = server.sample(timeout=5)
    assert s is not None
    assert s.batch["id"].tolist() == [3, 3, 3, 3]
    assert s.times_sampled.tolist() == [1, 2, 3, 4]
    s = server.sample(timeout=5)
    assert s is not None
    assert s.times_sampled.tolist() == [5, 6, 7, 8]
    server.close()


@pytest.mark.parametrize("sampler", SAMPLERS, ids=["uniform", "prioritized"])
def test_a_batch_that_runs_out_of_draws_waits_for_more_and_loses_none(sampler: Any) -> None:
    server = echo.Server(example(), 4, sampler=sampler, max_size=10, max_times_sampled=1)
    server.submit(make(0))
    with pytest.raises(TimeoutError, match=r"cannot fill a batch of 4: .*max_times_sampled=1"):
        server.sample(timeout=0.2)  # one entry, drawn once at most: no batch of 4
    assert server.stats().store_size == 1  # put back, not spent
    for i in range(1, 4):
        server.submit(make(i))
    s = server.sample(timeout=5)
    assert s is not None
    assert sorted(s.batch["id"].tolist()) == [0, 1, 2, 3]
    assert s.times_sampled.tolist() == [1, 1, 1, 1]
    assert server.stats().store_size == 0
    server.close()


@pytest.mark.parametrize("sampler", [echo.Fifo(), *SAMPLERS], ids=["fifo", "uniform", "prior"])
def test_a_group_the_arena_can_never_hold_is_refused_and_evicts_nothing(sampler: Any) -> None:
    fifo = isinstance(sampler, echo.Fifo)
    sizes: dict[str, Any] = {"num_buffers": 3} if fifo else {"max_size": 100}
    server = echo.Server(example(), 8, sampler=sampler, max_bytes=40_000, **sizes)
    for i in range(4):
        server.submit(make(i, 10))
    group = [make(9, 1024)] * 8  # 8 x 4 KiB of one leaf: more blocks than the arena has
    with pytest.raises(ValueError, match=r"does not fit in the table's arena even empty"):
        server.submit_group(group, timeout=1)
    stats = server.stats()
    assert (stats.store_size, stats.evicted_total) == (4, 0)
    server.close()


def test_a_min_size_above_max_size_is_refused() -> None:
    with pytest.raises(ValueError, match=r"MinSize\(10\).*max_size \(4\)"):
        echo.Server(example(), 2, sampler=echo.Uniform(), max_size=4, rate_limiter=echo.MinSize(10))


def test_update_priorities_checks_its_arrays_as_any_server_does() -> None:
    server = echo.Server(example(), 2, sampler=echo.Prioritized(1.0), max_size=10)
    server.submit(make(0))
    with pytest.raises(ValueError, match=r"keys must be 1-D, got shape \(1, 2\)"):
        server.update_priorities([[1, 2]], [1.0, 2.0])
    with pytest.raises(ValueError, match=r"keys must be >= 0, got -1"):
        server.update_priorities([-1], [1.0])
    with pytest.raises(ValueError, match=r"2 keys but 1 priorities"):
        server.update_priorities([1, 2], [1.0])
    s = server.sample(timeout=5)
    assert s is not None
    assert server.update_priorities(s.keys, [0.5, 0.5]) == 0
    keys = np.array([12345, *s.keys], np.uint64)
    assert server.update_priorities(keys, [1.0, 2.0, 2.0]) == 1  # one gone
    server.close()


def test_a_timeout_says_what_holds_the_batch_back() -> None:
    server = echo.Server(example(), 2, sampler=echo.Prioritized(1.0), max_size=10)
    with pytest.raises(TimeoutError, match=r"the table holds 0, 1 needed"):
        server.sample(timeout=0.1)
    for i in range(3):
        server.submit(make(i), priority=0.0)
    with pytest.raises(TimeoutError, match=r"every one of the 3 samples stored has priority 0"):
        server.sample(timeout=0.1)
    server.close()
    fifo = echo.Server(example(), 4)
    fifo.submit(make(0))
    with pytest.raises(TimeoutError, match=r"1 wait; a batch closes at batch_size 4"):
        fifo.sample(timeout=0.1)
    fifo.close()
