"""FIFO exactly-once delivery with one or several producer threads, several consumer threads,
and the GIL released while a thread waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

# Bound on any single blocking step before it counts as a hang.
WAIT_S = 10.0


def test_single_producer_gets_every_sample_exactly_once_in_order(
    make_server: Any, make_sample: Any, batch_ids: Any, spawn: Any
) -> None:
    server = make_server(batch_size=4, num_buffers=3)
    num_batches = 50  # many laps of the ring: the producer must wait for the consumer

    def produce() -> None:
        for i in range(num_batches * 4):
            server.submit(make_sample(i), timeout=WAIT_S)

    producer = spawn(produce)
    seen: list[int] = []
    for expected_sequence in range(num_batches):
        sample = server.sample(timeout=WAIT_S)
        assert sample is not None
        assert sample.info.sequence == expected_sequence
        seen.extend(batch_ids(sample.batch))
    producer.finish()
    assert seen == list(range(num_batches * 4))


def test_samples_submitted_before_sampling_come_out_in_order(
    make_server: Any, make_sample: Any, batch_ids: Any
) -> None:
    server = make_server(batch_size=3, num_buffers=4)
    for i in range(12):  # fills the ring exactly
        server.submit(make_sample(i), timeout=0)
    seen = []
    for _ in range(4):
        sample = server.sample(timeout=WAIT_S)
        assert sample is not None
        seen.extend(batch_ids(sample.batch))
    assert seen == list(range(12))


@pytest.mark.parametrize(("num_producers", "batch_size"), [(2, 1), (4, 8), (5, 3)])
def test_several_producer_threads_deliver_exactly_once_in_per_thread_order(
    make_server: Any,
    make_sample: Any,
    batch_ids: Any,
    spawn: Any,
    num_producers: int,
    batch_size: int,
) -> None:
    per_producer = 240  # divisible by every batch_size * num_producers combination above
    server = make_server(batch_size=batch_size, num_buffers=3)
    start = threading.Barrier(num_producers + 1)

    def produce(p: int) -> None:
        start.wait(WAIT_S)
        for seq in range(per_producer):
            server.submit(make_sample(p * 1_000_000 + seq), timeout=WAIT_S)

    producers = [spawn(produce, p) for p in range(num_producers)]
    start.wait(WAIT_S)
    total = num_producers * per_producer
    assert total % batch_size == 0
    seen: list[int] = []
    deadline = time.monotonic() + 30
    while len(seen) < total:
        assert time.monotonic() < deadline, f"only {len(seen)} of {total} samples arrived"
        sample = server.sample(timeout=WAIT_S)
        assert sample is not None
        seen.extend(batch_ids(sample.batch))
    for producer in producers:
        producer.finish()
    assert len(seen) == total
    assert sorted(seen) == sorted(
        p * 1_000_000 + s for p in range(num_producers) for s in range(per_producer)
    )
    for p in range(num_producers):
        mine = [x - p * 1_000_000 for x in seen if x // 1_000_000 == p]
        assert mine == list(range(per_producer)), f"producer {p} out of order"


def _consume_until_closed(
    server: Any, batch_ids: Any, copy: bool, start: threading.Barrier, on_batch: Any
) -> list[tuple[int, list[int]]]:
    got: list[tuple[int, list[int]]] = []
    start.wait(WAIT_S)
    while True:
        sample = server.sample(timeout=WAIT_S, copy=copy)
        if sample is None:
            return got
        got.append((sample.info.sequence, batch_ids(sample.batch)))
        on_batch()


@pytest.mark.parametrize("copy", [True, False], ids=["copies-live-producer", "views-preloaded"])
def test_two_threads_sampling_at_once_each_batch_goes_to_exactly_one(
    make_server: Any, make_sample: Any, batch_ids: Any, spawn: Any, copy: bool
) -> None:
    batch_size, num_batches = 4, 40
    if copy:
        # A producer keeps refilling a small ring: copies are taken while the batch is held.
        server = make_server(batch_size=batch_size, num_buffers=3)
    else:
        # Views are only meaningful until the next sample() (by any thread), so preload
        # everything into a ring large enough that no slot is ever rewritten.
        server = make_server(batch_size=batch_size, num_buffers=num_batches + 1)
        for i in range(num_batches * batch_size):
            server.submit(make_sample(i), timeout=0)

    lock = threading.Lock()
    delivered = [0]
    all_delivered = threading.Event()

    def on_batch() -> None:
        with lock:
            delivered[0] += 1
            if delivered[0] == num_batches:
                all_delivered.set()

    start = threading.Barrier(2)
    consumers = [
        spawn(_consume_until_closed, server, batch_ids, copy, start, on_batch) for _ in range(2)
    ]
    if copy:
        producer = spawn(
            lambda: [
                server.submit(make_sample(i), timeout=WAIT_S)
                for i in range(num_batches * batch_size)
            ]
        )
    assert all_delivered.wait(30), f"only {delivered[0]} of {num_batches} batches delivered"
    if copy:
        producer.finish()
    server.close()
    results = [c.finish() for c in consumers]
    batches = sorted(results[0] + results[1])
    assert [seq for seq, _ in batches] == list(range(num_batches))
    for seq, ids in batches:
        assert ids == list(range(seq * batch_size, (seq + 1) * batch_size))
    # Each thread saw its own batches in increasing order.
    for result in results:
        sequences = [seq for seq, _ in result]
        assert sequences == sorted(sequences)


def _python_progress_while(call: Callable[[], Any], spawn: Any) -> int:
    """How far a pure-Python counting thread (it needs the GIL) gets while `call()` runs here."""
    counter = [0]
    running = threading.Event()
    stop = threading.Event()

    def count() -> None:
        running.set()
        while not stop.is_set():
            counter[0] += 1

    counter_thread = spawn(count)
    try:
        assert running.wait(WAIT_S)
        before = counter[0]
        call()
        return counter[0] - before
    finally:
        stop.set()
        counter_thread.finish()


def _times_out(call: Callable[..., Any], *args: Any) -> Callable[[], None]:
    def run() -> None:
        with pytest.raises(TimeoutError):
            call(*args, timeout=0.3)

    return run


def test_other_threads_run_while_sample_waits(make_server: Any, spawn: Any) -> None:
    server = make_server(batch_size=2)
    # With the GIL held for 0.3 s the counter could not move (the main thread never yields
    # it from inside native code); released, a Python loop counts far beyond this.
    assert _python_progress_while(_times_out(server.sample), spawn) > 1000


def test_another_thread_can_complete_the_batch_that_sample_waits_for(
    make_server: Any, make_sample: Any, batch_ids: Any, spawn: Any
) -> None:
    server = make_server(batch_size=3)
    start = threading.Barrier(2)
    counted = [0]

    def count_then_submit() -> None:
        start.wait(WAIT_S)
        for _ in range(200_000):  # pure-Python progress, needs the GIL
            counted[0] += 1
        for i in range(3):
            server.submit(make_sample(i), timeout=WAIT_S)

    worker = spawn(count_then_submit)
    start.wait(WAIT_S)
    sample = server.sample(timeout=WAIT_S)
    worker.finish()
    assert sample is not None
    assert counted[0] == 200_000
    assert batch_ids(sample.batch) == [0, 1, 2]


def test_other_threads_run_while_submit_waits_for_space(
    make_filled: Any, make_sample: Any, spawn: Any
) -> None:
    server = make_filled(2, batch_size=1, num_buffers=2)
    assert _python_progress_while(_times_out(server.submit, make_sample(2)), spawn) > 1000


def test_large_samples_from_several_threads_are_never_torn(make_server: Any, spawn: Any) -> None:
    # 128 KiB per sample: copied with the GIL released, so threads really overlap.
    example = {"block": np.zeros((16_384,), np.int64)}
    server = make_server(ex=example, batch_size=2, num_buffers=2)
    num_producers, per_producer = 3, 20

    def produce(p: int) -> None:
        for seq in range(per_producer):
            server.submit({"block": np.full((16_384,), p * 1000 + seq, np.int64)}, timeout=WAIT_S)

    producers = [spawn(produce, p) for p in range(num_producers)]
    seen = []
    for _ in range(num_producers * per_producer // 2):
        sample = server.sample(timeout=WAIT_S)
        assert sample is not None
        block = sample.batch["block"]
        for row in block:
            assert (row == row[0]).all(), "a slot mixes two samples"
            seen.append(int(row[0]))
    for producer in producers:
        producer.finish()
    assert sorted(seen) == sorted(
        p * 1000 + s for p in range(num_producers) for s in range(per_producer)
    )
    for p in range(num_producers):
        assert [x for x in seen if x // 1000 == p] == [p * 1000 + s for s in range(per_producer)]
