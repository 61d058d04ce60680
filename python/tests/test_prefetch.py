"""`dataset_iter(prefetch=N)` and `dataset_iter(device=...)`: a background thread copies each
batch out of the ring; every batch arrives once and in order, errors reach the consumer, and
leaving the loop or closing the server leaves no thread behind.

The thread machinery is the same for numpy copies (`copy=True, prefetch=N`, run everywhere)
and torch devices (`device="cpu"` here; torch tests skip where torch is not installed)."""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from testkit.frameworks import needs_torch

from echo import Server
from echo._prefetch import Prefetcher

EXAMPLE = {"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}
BATCH = 4
WAIT_S = 10.0


def sample_of(i: int) -> dict[str, np.ndarray]:
    return {"id": np.asarray(i, np.int64), "obs": np.full(3, i, np.float32)}


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "echo-prefetch" and t.is_alive()]


def ids_of(batch: dict[str, Any]) -> list[int]:
    """The batch's ids, after checking every slot is whole (obs encodes the id)."""
    ids = np.asarray(batch["id"])
    np.testing.assert_array_equal(np.asarray(batch["obs"]), np.repeat(ids[:, None], 3, axis=1))
    return [int(i) for i in ids]


def produce_then_drain(server: Server, count: int) -> threading.Thread:
    """Submits `count` samples from another thread, then closes with drain=True (so every full
    batch is still handed out and the iterator then ends)."""

    def run() -> None:
        for i in range(count):
            server.submit(sample_of(i), timeout=WAIT_S)
        server.close(drain=True)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def no_prefetch_thread_left() -> Iterator[None]:
    yield
    leaked = prefetch_threads()
    assert not leaked, f"prefetch threads still running: {leaked}"


@pytest.mark.usefixtures("no_prefetch_thread_left")
@pytest.mark.parametrize("depth", [1, 2, 5])
def test_prefetched_copies_arrive_once_and_in_order(depth: int) -> None:
    server = Server(EXAMPLE, batch_size=BATCH, num_buffers=2)
    producer = produce_then_drain(server, BATCH * 50)
    seen: list[int] = []
    for sample in server.dataset_iter(copy=True, prefetch=depth, timeout=WAIT_S):
        assert sample.batch["obs"].flags.writeable  # a private copy
        seen += ids_of(sample.batch)
    producer.join(WAIT_S)
    assert seen == list(range(BATCH * 50))


@pytest.mark.usefixtures("no_prefetch_thread_left")
def test_break_stops_and_joins_the_thread() -> None:
    server = Server(EXAMPLE, batch_size=BATCH)
    for i in range(BATCH * 3):
        server.submit(sample_of(i))
    for sample in server.dataset_iter(copy=True, prefetch=2):
        assert ids_of(sample.batch) == [0, 1, 2, 3]
        break
    # the loop's iterator is gone (refcount), its finally joined the thread
    assert prefetch_threads() == []
    server.close()


@pytest.mark.usefixtures("no_prefetch_thread_left")
def test_closing_the_iterator_while_the_thread_waits_for_a_batch_joins_it() -> None:
    server = Server(EXAMPLE, batch_size=BATCH)
    for i in range(BATCH):
        server.submit(sample_of(i))
    batches = server.dataset_iter(copy=True, prefetch=2)
    assert ids_of(next(batches).batch) == [0, 1, 2, 3]
    batches.close()  # the thread is blocked in sample(): no further batch is coming
    assert prefetch_threads() == []
    server.close()


@pytest.mark.usefixtures("no_prefetch_thread_left")
def test_server_close_ends_the_iteration() -> None:
    server = Server(EXAMPLE, batch_size=BATCH)
    batches = server.dataset_iter(copy=True, prefetch=2)
    closer = threading.Timer(0.0, server.close)  # from another thread, while next() waits
    closer.start()
    assert list(batches) == []
    closer.join(WAIT_S)


@pytest.mark.usefixtures("no_prefetch_thread_left")
def test_a_timeout_is_raised_after_the_batches_before_it() -> None:
    server = Server(EXAMPLE, batch_size=BATCH)
    for i in range(BATCH + 1):  # one full batch, then one sample short of the next
        server.submit(sample_of(i))
    batches = server.dataset_iter(copy=True, prefetch=3, timeout=0.2)
    assert ids_of(next(batches).batch) == [0, 1, 2, 3]
    with pytest.raises(TimeoutError, match=r"prefetch thread waited 0\.2 s"):
        next(batches)
    with pytest.raises(StopIteration):
        next(batches)
    server.close()


def test_prefetch_without_device_needs_copy() -> None:
    server = Server(EXAMPLE, batch_size=BATCH)
    with pytest.raises(ValueError, match="prefetch without device needs copy=True"):
        next(server.dataset_iter(prefetch=2))
    server.close()


@pytest.mark.parametrize("depth", [0, -1])
def test_prefetch_must_be_positive(depth: int) -> None:
    server = Server(EXAMPLE, batch_size=BATCH)
    with pytest.raises(ValueError, match="prefetch"):
        next(server.dataset_iter(copy=True, prefetch=depth))
    server.close()


@pytest.mark.usefixtures("no_prefetch_thread_left")
def test_an_error_of_the_thread_reaches_the_consumer_in_order() -> None:
    items = iter([1, 2])

    def fetch(wait_s: float) -> int:
        item = next(items, None)
        if item is None:
            raise RuntimeError("copy failed")
        return item

    prefetcher = iter(Prefetcher(fetch, 2, None))
    assert next(prefetcher) == 1
    assert next(prefetcher) == 2
    with pytest.raises(RuntimeError, match="copy failed"):
        next(prefetcher)


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed")
def test_device_without_torch_is_a_clear_import_error() -> None:
    server = Server(EXAMPLE, batch_size=BATCH)
    with pytest.raises(ImportError, match="needs PyTorch"):
        next(server.dataset_iter(device="cpu"))
    server.close()


@needs_torch
@pytest.mark.usefixtures("no_prefetch_thread_left")
def test_device_cpu_yields_tensors_once_and_in_order() -> None:
    import torch

    server = Server(EXAMPLE, batch_size=BATCH, num_buffers=2)
    producer = produce_then_drain(server, BATCH * 50)
    seen: list[int] = []
    for sample in server.dataset_iter(device="cpu", prefetch=2, timeout=WAIT_S):
        assert isinstance(sample.batch["obs"], torch.Tensor)
        assert sample.batch["obs"].device.type == "cpu"
        seen += ids_of({k: v.numpy() for k, v in sample.batch.items()})
    producer.join(WAIT_S)
    assert seen == list(range(BATCH * 50))


@needs_torch
@pytest.mark.usefixtures("no_prefetch_thread_left")
def test_device_cpu_tensors_are_copies_not_ring_views() -> None:
    server = Server(EXAMPLE, batch_size=BATCH)
    for i in range(BATCH * 2):
        server.submit(sample_of(i))
    sample = next(server.dataset_iter(device="cpu", prefetch=1))
    server.close()
    # the slots went back to the writers when the copy was done: the tensor must own its data
    assert ids_of({k: v.numpy() for k, v in sample.batch.items()}) == [0, 1, 2, 3]


def test_close_while_a_copy_is_under_way_stops_the_thread_promptly() -> None:
    """The copy under way when `close()` empties the queue refills it; the thread must then
    see the stop flag, not wait for ever to queue its end marker behind that copy."""
    in_fetch, release = threading.Event(), threading.Event()

    def fetch(wait_s: float) -> object:
        in_fetch.set()
        release.wait(WAIT_S)
        return object()

    prefetcher = Prefetcher(fetch, 1, None)
    assert in_fetch.wait(WAIT_S)
    closer = threading.Thread(target=prefetcher.close)
    closer.start()
    time.sleep(0.2)  # close() has set the flag, emptied the queue, and waits for the thread
    release.set()  # the copy under way finishes and refills the queue
    closer.join(5.0)
    assert not closer.is_alive(), "close() waited for a thread blocked queueing after the stop"
    assert not prefetcher.alive


needs_jax = pytest.mark.skipif(
    importlib.util.find_spec("jax") is None, reason="JAX is not installed (the test extra)"
)


@needs_jax
@pytest.mark.usefixtures("no_prefetch_thread_left")
def test_jax_cpu_device_yields_committed_arrays_once_and_in_order() -> None:
    import jax

    cpu = jax.devices("cpu")[0]
    server = Server(EXAMPLE, batch_size=BATCH, num_buffers=2)
    producer = produce_then_drain(server, BATCH * 50)
    seen: list[int] = []
    for sample in server.dataset_iter(device=cpu, prefetch=2, timeout=WAIT_S):
        assert isinstance(sample.batch["obs"], jax.Array)
        assert sample.batch["obs"].devices() == {cpu}
        seen += ids_of({k: np.asarray(v) for k, v in sample.batch.items()})
    producer.join(WAIT_S)
    assert seen == list(range(BATCH * 50))


@needs_jax
def test_jax_cpu_arrays_do_not_alias_the_ring() -> None:
    """JAX may alias host memory on a CPU device; a batch whose slots went back to the
    writers must keep its values while they are overwritten."""
    import jax

    server = Server(EXAMPLE, batch_size=BATCH, num_buffers=2)
    for i in range(BATCH * 2):
        server.submit(sample_of(i))
    batches = server.dataset_iter(device=jax.devices("cpu")[0], prefetch=1, timeout=WAIT_S)
    first = next(batches)
    # The thread's next sample() gave the first batch's slots back; fill them with new ids.
    for i in range(BATCH * 2, BATCH * 3):
        server.submit(sample_of(i), timeout=WAIT_S)
    second = next(batches)
    third = next(batches)  # written into the first batch's slots
    assert ids_of({k: np.asarray(v) for k, v in first.batch.items()}) == [0, 1, 2, 3]
    assert ids_of({k: np.asarray(v) for k, v in second.batch.items()}) == [4, 5, 6, 7]
    assert ids_of({k: np.asarray(v) for k, v in third.batch.items()}) == [8, 9, 10, 11]
    batches.close()
    server.close()


@needs_jax
@pytest.mark.parametrize("sampler", ["fifo", "replay"])
def test_sample_to_a_jax_device_returns_a_finished_private_copy(sampler: str) -> None:
    import jax

    import echo

    cpu = jax.devices("cpu")[0]
    replay = {"sampler": echo.Lifo(), "max_size": BATCH} if sampler == "replay" else {}
    server = Server(EXAMPLE, batch_size=BATCH, num_buffers=2, **replay)
    for i in range(BATCH):
        server.submit(sample_of(i))
    sample = server.sample(timeout=WAIT_S, device=cpu)
    assert sample is not None
    assert isinstance(sample.batch["obs"], jax.Array)
    assert sample.batch["obs"].devices() == {cpu}
    first = sorted(ids_of({k: np.asarray(v) for k, v in sample.batch.items()}))
    assert first == [0, 1, 2, 3]
    # The slots (or the replay batch area) are reused by what comes next; the copy stays.
    for i in range(BATCH, 2 * BATCH):
        server.submit(sample_of(i), timeout=WAIT_S)
    assert server.sample(timeout=WAIT_S) is not None  # gives the first batch's slots back
    for i in range(2 * BATCH, 3 * BATCH):
        server.submit(sample_of(i), timeout=WAIT_S)  # FIFO: into the first batch's slots
    assert sorted(ids_of({k: np.asarray(v) for k, v in sample.batch.items()})) == first
    server.close()


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed")
def test_sample_to_a_torch_device_without_torch_is_a_clear_import_error() -> None:
    server = Server(EXAMPLE, batch_size=BATCH)
    for i in range(BATCH):
        server.submit(sample_of(i))
    with pytest.raises(ImportError, match="needs PyTorch"):
        server.sample(timeout=WAIT_S, device="cpu")
    server.close()


@needs_torch
def test_sample_to_the_torch_cpu_device_returns_tensors() -> None:
    import torch

    server = Server(EXAMPLE, batch_size=BATCH)
    for i in range(BATCH):
        server.submit(sample_of(i))
    sample = server.sample(timeout=WAIT_S, device="cpu")
    assert sample is not None
    assert isinstance(sample.batch["obs"], torch.Tensor)
    assert ids_of({k: v.numpy() for k, v in sample.batch.items()}) == [0, 1, 2, 3]
    server.close()
