"""Prefetching batches in a background thread: `Server.dataset_iter(prefetch=N)`.

One thread takes batches from the server, copies each out of the ring (to a torch device, or
into private numpy arrays) and queues at most `N` of them for the consumer, so the learner's
step on one batch overlaps the copy of the next. The rules it keeps:

- Every batch is delivered once, in the order the server handed them out; then the end
  (the server closed) or the thread's error, which the consumer's `next()` raises.
- A batch's ring slots go back to the writers (the thread's next `sample()` call) only once
  its copy has completed: at once for a CPU copy, after the copy's CUDA event for a GPU.
- `close()` (the consumer's `break`, `Server.close()` or the iterator being collected) stops
  the thread and joins it: no thread outlives the iterator by more than one bounded wait.
"""

from __future__ import annotations

import importlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import optree

from echo._pytree import NONE_IS_LEAF
from echo._validate import check_int

__all__ = ["Prefetcher", "Transfer", "device_transfer", "jax_transfer", "torch_transfer"]

# How long the thread waits for a batch before it looks at its stop flag again. Only an idle
# server (no full batch) ever waits this long; a batch that arrives ends the wait at once.
_POLL_S = 0.05
# The longest `close()` waits for the thread: one poll, plus the copy of one batch.
_JOIN_S = 30.0

_END = object()


class _Failed:
    """The thread's exception, queued in order after the batches delivered before it."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher:
    """Runs `fetch()` in a thread, queueing at most `depth` results.

    `fetch(timeout)` returns the next item (a finished copy, whose ring slots it may give back
    on its next call), `None` at the end, or raises `TimeoutError` when nothing arrived
    within `timeout` seconds. `timeout` bounds each of the thread's waits for a batch, as in
    `sample(timeout=...)`; `None` waits as long as it takes.
    """

    def __init__(
        self,
        fetch: Callable[[float], Any],
        depth: int,
        timeout: float | None,
    ) -> None:
        self._fetch = fetch
        self._timeout = timeout
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="echo-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                item = self._next()
                if item is None or not self._put(item):
                    break
            self._put(_END)
        except BaseException as error:  # noqa: BLE001 -- every error goes to the consumer
            self._put(_Failed(error))

    def _put(self, item: Any) -> bool:
        """Queues `item`, waiting while the queue is full until the consumer takes one or
        `close()` sets the stop flag (then `False`: nobody will read it). A plain blocking
        put could outlive `close()`: the copy that was under way when it emptied the queue
        refills it, and the end marker after that would wait for ever."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
            except queue.Full:
                continue
            return True
        return False

    def _next(self) -> Any:
        """The next item; `None` at the end or once stopped."""
        timeout = self._timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._stop.is_set():
            slice_s = _POLL_S
            if deadline is not None:
                slice_s = min(slice_s, max(deadline - time.monotonic(), 0.0))
            try:
                return self._fetch(slice_s)
            except TimeoutError as error:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{error} (the prefetch thread waited {timeout} s for this batch)"
                    ) from error
        return None

    def __iter__(self) -> Iterator[Any]:
        try:
            while True:
                item = self._queue.get()
                if item is _END:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Stops the thread and waits for it (bounded). Idempotent."""
        self._stop.set()
        # Make room for a put the thread may be blocked in (it then sees the stop flag).
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN_S)

    @property
    def alive(self) -> bool:
        """Whether the thread is still running (for tests)."""
        return self._thread.is_alive()


class Transfer(NamedTuple):
    """How batches reach a device: `copy(tree)` returns the tree on the device, the copy
    finished when it returns (the tree's ring slots may then be given back).

    `private`: `copy` wants the batch as private numpy arrays (`sample(copy=True)`: one
    copy out of the ring, made in Rust with the GIL released) and adopts them without a
    second copy (a host device: a torch CPU tensor or a JAX CPU array may share their
    memory). Otherwise it reads the ring's views and copies from them itself (a GPU: the
    copy is the transfer).
    """

    copy: Callable[[Any], Any]
    private: bool


def device_transfer(device: Any) -> Transfer:
    """`jax_transfer` for a JAX device (`jax.devices()[0]`), else `torch_transfer`."""
    if type(device).__module__.split(".", 1)[0] in ("jax", "jaxlib"):
        return jax_transfer(device)
    return torch_transfer(device)


def jax_transfer(device: Any) -> Transfer:
    """The tree as JAX arrays committed to `device`.

    A CPU device takes the private copy (`Transfer.private`): `jax.device_put` of host memory
    on the CPU may alias it instead of copying, which the ring's slots, rewritten once given
    back, would not survive. Other devices (GPU, TPU) copy from the ring itself; the thread
    waits for the transfer (`block_until_ready`) before the slots go back.
    """
    jax: Any = importlib.import_module("jax")  # a JAX device implies JAX is importable
    on_cpu = getattr(device, "platform", None) == "cpu"

    def leaf_to_device(leaf: Any) -> Any:
        return jax.device_put(leaf, device)

    def to_device(tree: Any) -> Any:
        out: Any = optree.tree_map(leaf_to_device, tree, none_is_leaf=NONE_IS_LEAF)
        jax.block_until_ready(out)
        return out

    return Transfer(to_device, private=on_cpu)


def torch_transfer(device: Any) -> Transfer:
    """The tree as torch tensors on `device`.

    CPU: the private copy (`Transfer.private`), each leaf adopted by `torch.from_numpy`
    without another copy. CUDA, from the ring's writeable views: `non_blocking` copies on a
    side stream (real DMA when the ring is page-locked, `pin_host_memory=True`), an event
    recorded after them and waited for by this (the prefetch) thread; each tensor is
    recorded on the stream that was current when the iterator started, so the caching
    allocator does not hand its memory to a later copy while the learner's kernels may still
    read it.
    """
    try:
        torch: Any = importlib.import_module("torch")  # optional: typed as Any
    except ImportError as error:
        raise ImportError(
            "dataset_iter(device=...) copies batches into torch tensors and needs PyTorch "
            "(pip install torch)"
        ) from error

    target = torch.device(device)
    if target.type == "cpu":

        def to_cpu(tree: Any) -> Any:
            out: Any = optree.tree_map(torch.from_numpy, tree, none_is_leaf=NONE_IS_LEAF)
            return out

        return Transfer(to_cpu, private=True)
    if target.type != "cuda":
        raise ValueError(f"device must be a CPU or CUDA device, got {device!r}")
    if target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    side_stream = torch.cuda.Stream(device=target)
    consumer_stream = torch.cuda.current_stream(target)

    def leaf_to_cuda(leaf: Any) -> Any:
        return torch.from_numpy(leaf).to(target, non_blocking=True)

    def to_cuda(tree: Any) -> Any:
        with torch.cuda.stream(side_stream):
            out: Any = optree.tree_map(leaf_to_cuda, tree, none_is_leaf=NONE_IS_LEAF)
            done = torch.cuda.Event()
            done.record(side_stream)
        done.synchronize()  # the copy has read the ring: its slots may go back now
        for tensor in optree.tree_leaves(out, none_is_leaf=NONE_IS_LEAF):
            tensor.record_stream(consumer_stream)
        return out

    return Transfer(to_cuda, private=False)


def batches(
    take: Callable[..., Any],
    replay: bool,
    copy: bool,
    timeout: float | None,
    writable: bool,
    device: Any,
    prefetch: int | None,
) -> Iterator[Any]:
    """`Server.dataset_iter`: the batches `take` (a server's `sample`) hands out until it
    returns None, fetched ahead by a `Prefetcher` with `device` or `prefetch`. `replay`: the
    server's batch area is reused by the next draw (a GPU copy reads a private copy)."""
    if device is None and prefetch is None:
        while (got := take(timeout, copy=copy, writable=writable)) is not None:
            yield got
        return
    depth = check_int("prefetch", 2 if prefetch is None else prefetch, 1, 1 << 16)
    if device is None:
        if not copy:
            raise ValueError(
                "prefetch without device needs copy=True: views into the ring cannot be "
                "fetched ahead (the next sample() gives their slots back)"
            )

        def fetch(wait_s: float) -> Any:
            return take(wait_s, copy=True)

    else:
        transfer = device_transfer(device)
        # A replay table's batch area is reused by the next sample(): a GPU copy (which
        # reads it after sample() returns) takes a private copy of it first.
        private = transfer.private or replay

        def fetch(wait_s: float) -> Any:
            got = take(wait_s, copy=private, writable=not private)
            if got is None:
                return None
            return got._with_batch(transfer.copy(got.batch))  # pyright: ignore[reportPrivateUsage]

    yield from Prefetcher(fetch, depth, timeout)
