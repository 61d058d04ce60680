"""The learner side: `Server`, and the `Sample` it hands out."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

from echo._echo import RingServer, SampleInfo, ServerClosedError
from echo._pytree import TreeLayout
from echo._validate import check_int
from echo.transport import TcpTransport

__all__ = ["Sample", "Server"]


def _cuda_runtime_candidates() -> list[str]:
    """Where to look for the CUDA runtime, most specific first: $ECHO_CUDART, the runtimes of
    the NVIDIA wheels (`nvidia-cuda-runtime-cu12` installs `nvidia/cuda_runtime/lib`, the CUDA
    13 wheel `nvidia/cu13/lib`; PyTorch and JAX pull them in), then the loader's search path."""
    candidates: list[str] = []
    explicit = os.environ.get("ECHO_CUDART")
    if explicit:
        candidates.append(explicit)
    try:
        import nvidia  # pyright: ignore

        for root in nvidia.__path__:  # pyright: ignore
            pattern = os.path.join(str(root), "*", "lib", "libcudart.so*")  # pyright: ignore
            candidates += sorted(glob.glob(pattern), reverse=True)
    except ImportError:
        pass
    candidates += ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]
    return candidates


class Sample(NamedTuple):
    """One batch and the server's counters when it was handed out.

    `batch` has the example's structure; each leaf has shape `(batch_size, *leaf.shape)` and
    the leaf's dtype. Unless it came from `copy=True`, every leaf is a read-only view into the
    ring that is only meaningful until the next `sample()` call (see the zero-copy guide).
    """

    batch: Any
    info: SampleInfo


class Server:
    """A replay buffer that assembles single samples into fixed-size batches.

    Args:
        example: A pytree (nested dict / tuple / list / namedtuple) whose leaves are numpy
            arrays. It fixes the structure, each leaf's shape and dtype; the values are unused.
        batch_size: Samples per batch.
        transport: Where samples come from besides `submit()`. `None` (the default) for
            in-process use.
        num_buffers: Batches the ring holds (at least 2: one for the consumer, one being
            filled).
        num_drainers: The most drainer threads moving samples from connection queues into the
            ring. At most one per CPU core is started: more only race each other for ring
            space and serve connections unevenly.
        producer_queue_size: Capacity of each connection's ingress queue, in samples.
        pin_host_memory: Page-lock every ring buffer with `cudaHostRegister`, so copies of a
            batch to a GPU are real DMA (`non_blocking=True` in PyTorch). The CUDA runtime is
            loaded at run time ($ECHO_CUDART, the nvidia-cuda-runtime wheel, or the loader's
            path); unregistered when the last view of the ring is gone.

    Raises:
        TypeError: A leaf of `example` is not a numpy array, or an argument has the wrong type.
        ValueError: An argument is out of range, or `example` holds no data.
        RuntimeError: `pin_host_memory=True` where CUDA is unavailable (no runtime library,
            no device) or registration fails.
    """

    def __init__(
        self,
        example: Any,
        batch_size: int,
        transport: Any = None,
        num_buffers: int = 3,
        num_drainers: int = 8,
        producer_queue_size: int = 8,
        pin_host_memory: bool = False,
    ) -> None:
        batch_size = check_int("batch_size", batch_size, 1)
        num_buffers = check_int("num_buffers", num_buffers, 2)
        self._num_drainers = check_int("num_drainers", num_drainers, 1)
        self._producer_queue_size = check_int("producer_queue_size", producer_queue_size, 1)
        if transport is not None and not isinstance(transport, TcpTransport):
            raise TypeError(
                f"transport must be a TcpTransport or None, got {type(transport).__name__}"
            )
        self._layout = TreeLayout(example)
        leaves = self._layout.leaves
        self._core = RingServer(
            [leaf.shape for leaf in leaves],
            [leaf.dtype for leaf in leaves],
            [leaf.name for leaf in leaves],
            batch_size,
            num_buffers,
            self._layout.flat_keys,
        )
        if pin_host_memory:
            try:
                self._core.pin_host_memory(_cuda_runtime_candidates())
            except BaseException:
                self._core.close()
                raise
        self._transport: TcpTransport | None = transport
        self._port: int | None = None

    @property
    def batch_size(self) -> int:
        """Samples per batch."""
        return self._core.batch_size

    @property
    def num_buffers(self) -> int:
        """Batches the ring holds."""
        return self._core.num_buffers

    @property
    def pinned(self) -> bool:
        """Whether the ring is page-locked for DMA (`pin_host_memory=True`)."""
        return self._core.pinned

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._core.closed

    @property
    def port(self) -> int | None:
        """The transport's bound port after `start()` (so `TcpTransport(port=0)` works);
        `None` before `start()` or without a transport."""
        return self._port

    def start(self) -> None:
        """Binds the transport and starts accepting (a no-op without one). Idempotent.

        Raises:
            ServerClosedError: The server was closed.
            OSError: The port is in use (the message names host and port) or cannot be bound.
        """
        if self._core.closed:
            raise ServerClosedError("start(): the server is closed")
        transport = self._transport
        if transport is None or self._port is not None:
            return
        self._port = self._core.start_tcp(
            transport.host,
            transport.port,
            transport.num_threads,
            transport.max_connections,
            self._num_drainers,
            self._producer_queue_size,
        )

    def submit(self, sample: Any, *, timeout: float | None = None) -> None:
        """Copies one sample into the ring (in-process ingress).

        Blocks, with the GIL released, while the ring is full.

        Args:
            sample: A pytree with the example's structure, shapes and dtypes.
            timeout: Seconds to wait for space; `None` waits as long as it takes.

        Raises:
            ValueError: The structure or a leaf's shape differs from the example.
            TypeError: A leaf is not a numpy array or has another dtype.
            ServerClosedError: The server is (or gets) closed.
            TimeoutError: No space freed up within `timeout`.
        """
        try:
            # A flat-dict sample is looked up by key natively; anything else is flattened here.
            if not self._core.submit_flat(sample, timeout):
                self._core.submit(self._layout.flatten(sample), timeout)
        except TypeError:
            self._layout.check_structure(sample)  # a nested container is a structure error
            raise

    def sample(self, timeout: float | None = None, *, copy: bool = False) -> Sample | None:
        """Waits for the next full batch and returns it, or `None` once the server is closed.

        Calling `sample()` gives the previous batch's slots back to the writers, so views from
        the previous call may show newer data from then on.

        Args:
            timeout: Seconds to wait; `None` waits as long as it takes.
            copy: Return private, writeable copies instead of read-only views into the ring.

        Raises:
            TimeoutError: No full batch arrived within `timeout`.
            KeyboardInterrupt: Ctrl-C while waiting.
        """
        got = self._core.sample(timeout, copy)
        if got is None:
            return None
        leaves, info = got
        return Sample(self._layout.unflatten(leaves), info)

    def dataset_iter(self, *, copy: bool = False) -> Iterator[Sample]:
        """Yields batches until the server is closed.

        Args:
            copy: Yield private copies that stay valid forever (instead of views that are only
                meaningful until the next batch is requested).
        """
        while (sample := self.sample(copy=copy)) is not None:
            yield sample

    def stats(self) -> SampleInfo:
        """The server's counters now, without sampling (`sequence` and `wait_ns` are 0)."""
        return self._core.stats()

    def reset_histograms(self) -> None:
        """Clears the timing histograms; counters keep counting."""
        self._core.reset_histograms()

    def close(self) -> None:
        """Shuts down: a `sample()` blocked in another thread returns `None`, a blocked
        `submit()` raises `ServerClosedError`. Idempotent. Existing views stay readable."""
        self._core.close()

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Server(batch_size={self.batch_size}, num_buffers={self.num_buffers}, "
            f"leaves={len(self._layout.leaves)}, closed={self.closed})"
        )
