"""The learner side: `Server` (the `Sample` it hands out is in `echo.sample`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from typing_extensions import Self

from echo._echo import SampleInfo, SampleWriter, ServerClosedError, ServerCore
from echo._params import ParamsChannel
from echo._periodic import PeriodicCheckpointer
from echo._prefetch import Transfer, batches, device_transfer
from echo._pytree import TreeLayout
from echo._server_args import (
    PERIODIC_JOIN_S,
    ServerConfig,
    cuda_runtime_candidates,
    keys_array,
    periodic_args,
    priorities_array,
    versions_args,
)
from echo._server_checkpoints import Checkpoints
from echo._tally import Tally
from echo._validate import ConstructorSignature, check_bool, check_int
from echo.compression import Codec, Compress
from echo.compression import resolve as resolve_compress
from echo.replay import Fifo, RateLimiter, Remover, Sampler, Sequence, Uniform
from echo.sample import Sample
from echo.transport import TcpTransport

__all__ = ["Sample", "Server"]


class Server(Checkpoints):
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
        producer_queue_size: Capacity of each connection's ingress queue, in samples: how many
            a TCP connection's samples may be acknowledged but not yet in the ring. `None`
            (the default): enough samples for 64 KiB, at least 8 and at most 256 (see
            `Server.producer_queue_size` for the value chosen), so that small samples, and
            `send_batch` above all, are not held up by one drainer wake-up every 8 samples.
        pin_host_memory: Page-lock every ring buffer with `cudaHostRegister`, so copies of a
            batch to a GPU are real DMA (`non_blocking=True` in PyTorch). The CUDA runtime is
            loaded at run time ($ECHO_CUDART, the nvidia-cuda-runtime wheel, or the loader's
            path); unregistered when the last view of the ring is gone. With a replay sampler
            the batch area (what a learner copies to the GPU) is page-locked instead.
        sampler: `Fifo()` (default): the zero-copy ring, each sample handed out once.
            `Uniform()`, `Prioritized(exponent)` or `Lifo()`: a replay table of `max_size`
            items drawn many times (see `echo.replay` and the replay guide).
        remover: Replay only. Which item a full table evicts: `Fifo()` (default), `Lifo()`,
            `MinPriority()`.
        max_size: Replay only, required there. Items the table holds (pre-allocated).
        rate_limiter: `MinSize(n)`, `SampleToInsertRatio(...)` or `Queue(size)`. Replay
            default: `MinSize(1)` (sampling starts with the first item). With `Fifo()` only
            `Queue(size)` is accepted; it sizes the ring.
        max_times_sampled: Replay only. Remove an item after this many draws (0: never).
        seed: Replay only. Fixes the sampling sequence, for reproducible runs.
        compress: Which leaves a replay or sequence table stores compressed (with `Fifo()`:
            which leaves TCP workers send compressed): a mapping of leaf paths (`"obs"`,
            `"obs/pixels"` or `("obs", "pixels")`; a subtree's path covers its leaves) to
            `echo.Zstd(level)` or `echo.Lz4()`; `"auto"` (uint8/int8 leaves of at least 4 KiB,
            with `Zstd(1)`); or one codec (those same leaves with it). A replay table
            compresses each item on the inserting thread; a sequence table compresses each
            chunk of one stream's consecutive steps once it is full (or its stream is gone),
            on background threads, which gains the most on consecutive frames. Either
            decompresses straight into each batch. See the compression guide.
        max_bytes: Replay and sequence tables. Bounds the bytes the data takes as stored
            (compressed leaves compressed; a sequence table's filling chunks raw): the table
            evicts (the remover's victims, or a sequence table's oldest chunks) until a new
            item or step fits, as it does at `max_size`, whichever bound is hit first. `None`
            (default): `max_size` alone.
        sequence: `Sequence(length, period, at_end)`: make this a sequence table, which takes
            steps of streams (`submit(step, stream=k, end_episode=...)`, `submit_batch` with
            one stream per row) and samples windows of `length` steps of one episode, each
            step stored once. `max_size` then counts steps (the oldest are evicted, with every
            window holding one); the sampler (default `Uniform()`), `rate_limiter` and
            `max_times_sampled` work on windows. See the sequences guide.
        checkpoint_dir: Write a checkpoint into this directory (created if
            missing) every `checkpoint_every` seconds, from a background thread, as
            `checkpoint_dir/ckpt-<n>` (`n` counting up, continuing above any already there);
            see `checkpoint()`. A failed one is logged (logger `"echo"`) and the server keeps
            serving; the next period tries again. `echo.checkpoint.periodic_checkpoints(dir)`
            lists them, oldest first.
        checkpoint_every: Seconds between periodic checkpoints (> 0); needs `checkpoint_dir`.
        checkpoint_keep: How many periodic checkpoints to keep (>= 1): after each one, all
            but the newest `checkpoint_keep` are deleted.
        checkpoint_extra: A callable taking no arguments, called on the periodic checkpoint
            thread at the start of each one; what it returns is that checkpoint's `extra`
            (see `checkpoint()`), e.g. the optimizer state and step. It runs while the learner
            goes on, so it must return a snapshot the learner does not modify afterwards
            (copies, or immutable JAX arrays). The data is never older than the extra. If it
            raises, that checkpoint fails (logged). Needs `checkpoint_dir`.
        name: The value of the `server` label of this server's series in `echo.metrics`
            (Prometheus), so that several servers in one process are told apart; `"default"`
            unless given. A non-empty str. Checkpoints record it and `restore()` keeps it, so
            a restarted learner's series go on under the same label.
        policy_versions: Every sample carries the version of the parameters that made it
            (`TcpClient` attaches the one it last fetched, `send(version=)` another), handed
            out as `Sample.versions`. Implied by `max_staleness`.
        max_staleness: A sample more than this many versions behind the latest `publish()`
            is stale: with `admission="drop"` it never reaches the learner (dropped at insert,
            or removed from a replay table when a draw meets it), counted in `stats()`; with
            `"block"`, workers that far behind wait in `send()` until they fetch newer
            parameters, and nothing is dropped. See the parameters guide.
        admission: `"drop"` (default) or `"block"`, as above; `"block"` needs `max_staleness`.
        batch_tokens: Examples with `echo.Ragged` leaves only (variable-length data; see
            `echo.ragged` and its guide): close a batch before the next sample or group
            would take `token_group`'s rows past this.
        token_group: The length group (or ragged leaf) `batch_tokens` counts; may be left
            out when the example has one length group.
        layout: Ragged leaves as `"packed"` (default: `echo.Packed`) or `"padded"`
            (`echo.Padded`).
        pad_to_multiple: With `"padded"`, round the padded length up to a multiple of this.

    Raises:
        TypeError: A leaf of `example` is not a numpy array, or an argument has the wrong type.
        ValueError: An argument is out of range, `example` holds no data, only one of
            `checkpoint_dir` and `checkpoint_every` is given, or `checkpoint_extra` without
            them; `compress` names no leaf, or puts a codec on a floating-point leaf without
            `force=True`.
        RuntimeError: `pin_host_memory=True` where CUDA is unavailable (no runtime library,
            no device) or registration fails.
    """

    def __new__(cls, example: Any = None, *args: Any, **kwargs: Any) -> Self:  # pyright: ignore[reportInconsistentConstructor]
        """A `RaggedServer` when `example` has `echo.Ragged` leaves; otherwise `cls`'s own."""
        from echo._ragged_server import RaggedServer
        from echo.ragged import has_ragged_leaves

        if cls is Server and has_ragged_leaves(example):
            return cast("Self", object.__new__(RaggedServer))
        return object.__new__(cls)

    def __init__(  # pyright: ignore[reportInconsistentConstructor]
        self,
        example: Any,
        batch_size: int,
        transport: Any = None,
        num_buffers: int = 3,
        num_drainers: int = 8,
        producer_queue_size: int | None = None,
        pin_host_memory: bool = False,
        *,
        sampler: Sampler | None = None,
        remover: Remover | None = None,
        max_size: int | None = None,
        rate_limiter: RateLimiter | None = None,
        max_times_sampled: int = 0,
        seed: int | None = None,
        sequence: Sequence | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: float | None = None,
        checkpoint_keep: int = 3,
        checkpoint_extra: Callable[[], Any] | None = None,
        name: str = "default",
        compress: Compress = None,
        max_bytes: int | None = None,
        policy_versions: bool = False,
        max_staleness: int | None = None,
        admission: str = "drop",
        batch_tokens: int | None = None,
        token_group: str | None = None,
        layout: str = "packed",
        pad_to_multiple: int = 1,
    ) -> None:
        if (batch_tokens, token_group, layout, pad_to_multiple) != (None, None, "packed", 1):
            raise ValueError("batch_tokens, token_group, layout and pad_to_multiple are for "
                             "examples with echo.Ragged leaves; this example has none")  # fmt: skip
        self._periodic: PeriodicCheckpointer | None = None
        # Called (once, in order, with `restarting`) at the start of the first `close()`:
        # `echo.ray.serve` deregisters the shard there, before the connections close.
        self._close_hooks: list[Callable[[bool], object]] = []
        self._restored_extra: Any = None
        if not isinstance(name, str):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        if not name:
            raise ValueError("name must not be empty")
        self._name = name
        # What echo.metrics reads besides stats(): the learner's waits, checkpoint outcomes.
        self._tally = Tally()
        if sequence is not None and not isinstance(sequence, Sequence):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(
                f"sequence must be an echo.Sequence or None, got {type(sequence).__name__}"
            )
        # `sample(device=...)`'s copy functions, one per device (a CUDA one owns a stream).
        self._transfers: dict[tuple[str, str], Transfer] = {}
        config = ServerConfig(
            batch_size=check_int("batch_size", batch_size, 1),
            num_buffers=check_int("num_buffers", num_buffers, 2),
            num_drainers=check_int("num_drainers", num_drainers, 1, 1 << 16),
            producer_queue_size=None
            if producer_queue_size is None
            else check_int("producer_queue_size", producer_queue_size, 1, 1 << 16),
            sampler=(Fifo() if sequence is None else Uniform()) if sampler is None else sampler,
            remover=remover,
            rate_limiter=rate_limiter,
            max_size=None if max_size is None else check_int("max_size", max_size, 1),
            max_times_sampled=check_int("max_times_sampled", max_times_sampled, 0, 2**32 - 1),
            seed=None if seed is None else check_int("seed", seed, 0, 2**64 - 1),
            sequence=sequence,
            name=name,
        )
        if transport is not None and not isinstance(transport, TcpTransport):
            raise TypeError(
                f"transport must be a TcpTransport or None, got {type(transport).__name__}"
            )
        periodic = periodic_args(
            checkpoint_dir, checkpoint_every, checkpoint_keep, checkpoint_extra
        )
        self._layout = TreeLayout(example)
        config = dataclasses.replace(
            config,
            compress=resolve_compress(compress, self._layout),
            max_bytes=None if max_bytes is None else check_int("max_bytes", max_bytes, 1),
            **versions_args(policy_versions, max_staleness, admission),
        )
        self._compress: Compress = compress
        self._sampler: Sampler = config.sampler
        self._config = config
        self._core = ServerCore(self._layout, config)
        self._params = ParamsChannel(self._core)  # publish(), and its latest for checkpoints
        self._meta_names: tuple[str, ...] = tuple(self._core.meta_names)
        if type(self).submit is Server.submit:
            # The native method itself, which checks the arguments as `submit` documents: a
            # Python frame in between cost a third of a small sample's insert. A subclass
            # that overrides `submit` keeps its own.
            vars(self)["submit"] = self._core.submit
        if pin_host_memory:
            try:
                self._core.pin_host_memory(cuda_runtime_candidates())
            except BaseException:
                self._core.close()
                raise
        self._transport: TcpTransport | None = transport
        self._port: int | None = None
        if periodic is not None:
            self._start_periodic(periodic)

    @property
    def name(self) -> str:
        """The server's name: the `server` label of its series in `echo.metrics`."""
        return self._name

    @property
    def transport(self) -> TcpTransport | None:
        """The transport the server was built with (`None`: in-process only)."""
        return self._transport

    @property
    def batch_size(self) -> int:
        """Samples per batch."""
        return self._core.batch_size

    @property
    def num_buffers(self) -> int | None:
        """Batches the FIFO ring holds; `None` with a replay sampler."""
        return self._core.num_buffers

    @property
    def max_size(self) -> int | None:
        """Items a replay table holds; `None` for the FIFO ring."""
        return self._core.max_size

    @property
    def capacity(self) -> int:
        """The most samples the server holds at once: `num_buffers * batch_size` for the FIFO
        ring, `max_size` items for a replay table, `max_size` steps for a sequence table."""
        return self._core.capacity

    @property
    def compress(self) -> dict[str, Codec]:
        """The leaves the table stores compressed, by path (keys joined by `/`), and their
        codec: what `compress=` chose. Empty when nothing is compressed."""
        return {
            "/".join(str(key) for key in path): codec
            for path, codec in zip(self._layout.paths, self._config.compress, strict=False)
            if codec is not None
        }

    @property
    def max_bytes(self) -> int | None:
        """The bound on the bytes a replay table's items take as stored; `None`: none."""
        return self._config.max_bytes

    @property
    def sequence(self) -> Sequence | None:
        """How a sequence table cuts windows; `None` for FIFO and replay servers."""
        return self._config.sequence

    @property
    def num_drainers(self) -> int:
        """The most drainer threads the server may start, as given (at most one per CPU core
        is started)."""
        return self._config.num_drainers

    @property
    def producer_queue_size(self) -> int:
        """Capacity of each connection's ingress queue, in samples: the one given, or the one
        chosen for `producer_queue_size=None` (64 KiB of samples, between 8 and 256)."""
        return self._core.producer_queue_size

    @property
    def sampler(self) -> Sampler:
        """The sampler the server was built with."""
        return self._sampler

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
        self._port = self._core.start(transport)

    def submit(
        self,
        sample: Any,
        *,
        timeout: float | None = None,
        priority: float | None = None,
        stream: int | None = None,
        end_episode: bool = False,
        truncated: bool = False,
        version: int | None = None,
    ) -> None:
        """Copies one sample into the server (in-process ingress).

        Blocks, with the GIL released, while the ring is full (FIFO) or the rate limiter
        holds inserts back (replay).

        Args:
            sample: A pytree with the example's structure, shapes and dtypes. A leaf may be
                a numpy array or any array sharing its memory through `__dlpack__` (torch and
                JAX CPU arrays), `__array_interface__` or the buffer protocol; read without a
                copy when C-contiguous.
            timeout: Seconds to wait; `None` waits as long as it takes.
            priority: Replay only: the new item's priority. Default: the largest priority
                seen so far (1.0 at first), as in prioritized experience replay. For a
                sequence table, the step's priority: a new window's priority is the largest of
                its steps' (or, when none has one, the largest priority seen so far).
            stream: Sequence tables only: the stream the step belongs to, `0 <= stream <
                Sequence(max_streams)` (default 0). Each stream is one episode after another.
            end_episode: Sequence tables only: the step is its episode's last (terminated).
            truncated: Sequence tables only: the step is its episode's last, cut short (a
                time limit) rather than terminated. `end_episode` may be left False then.
            version: A server that keeps policy versions: the version of the parameters
                that made the sample (default: the latest published); ignored otherwise.

        Raises:
            ValueError: The structure or a leaf's shape differs from the example, the
                priority is invalid, `priority` was given to a FIFO server, or `stream`,
                `end_episode` or `truncated` to a server without `sequence=` (or `stream` is
                out of range).
            TypeError: A leaf is not an array (numpy, or anything with `__dlpack__`,
                `__array_interface__` or the buffer protocol) or has another dtype.
            ServerClosedError: The server is (or gets) closed.
            TimeoutError: No space freed up within `timeout`.
        """
        # Instances call the native method directly (see `__init__`); this is the same call,
        # for `Server.submit(server, ...)` and subclasses.
        self._core.submit(
            sample,
            timeout=timeout,
            priority=priority,
            stream=stream,
            end_episode=end_episode,
            truncated=truncated,
            version=version,
        )

    def submit_group(
        self,
        samples: list[Any] | tuple[Any, ...],
        *,
        timeout: float | None = None,
        priority: float | None = None,
        version: int | None = None,
    ) -> None:
        """Inserts `samples` (a list) as one group, atomically: handed out whole in one batch,
        never split, never partly evicted (the completions of one prompt, for GRPO). For
        servers with `echo.Ragged` leaves; a group may not hold more than `batch_size`
        samples, nor more rows than `batch_tokens`. `priority` is the group's; `version`
        (with policy versions) every sample's, else the current one.

        Raises:
            ValueError: The example has no ragged leaf, the group is empty or too large, or
                a sample is invalid (nothing of the group is stored then).
            TypeError: `samples` is not a list of samples.
        """
        raise ValueError("submit_group is for servers with echo.Ragged leaves; use submit()")

    def writer(self, *, timeout: float | None = None) -> SampleWriter:
        """A writer cached for this server's fixed layout: the fastest way to insert single
        samples from Python, for loops that produce them one at a time.

        `w = server.writer()`, then `w(*leaves)` copies one sample whose leaves are given
        positionally, in the example's flattened order (`w.leaves` names them; for a dict,
        optree sorts the keys: `{"obs": ..., "action": ...}` is `w(action, obs)`). It skips
        what `submit()` pays for a pytree (the call's keywords, the walk of the tree) and
        checks what it checks: each leaf's type, dtype and shape. Each call blocks like
        `submit()`, with the GIL released, up to `timeout`, and inserts with the default
        priority.

        Args:
            timeout: Seconds each call waits for room; `None` waits as long as it takes.

        Returns:
            The writer: call it with the leaves; `leaves` and `timeout` say what it takes.

        Raises:
            ValueError: The server is a sequence table (its steps need a stream and episode
                ends: use `submit()`), or `timeout` is negative. A call raises as
                `submit()` does, and ValueError for the wrong number of leaves.
        """
        return self._core.writer(timeout)

    @property
    def leaf_names(self) -> list[str]:
        """The example's leaves' names (`['obs']`) in flattened order: the order
        `writer()` takes them in."""
        return self._core.leaf_names

    def submit_batch(
        self,
        batch: Any,
        *,
        timeout: float | None = None,
        priority: Any = None,
        stream: int | None = None,
        end_episode: Any = None,
        truncated: Any = None,
        version: int | None = None,
    ) -> int:
        """Copies a batch of samples, one per row: what a vectorized environment's step gives.

        Every leaf has the example's dtype and shape with a leading dimension `N` in front,
        the same `N` for all leaves (`{"obs": (64, 4), "reward": (64,)}` for 64 samples of
        `{"obs": (4,), "reward": ()}`). The rows go in in order, exactly as `N` calls of
        `submit()` would put them, but the batch is checked once and copied in as few
        reservations as the ring allows. `N = 0` inserts nothing.

        Args:
            batch: A pytree with the example's structure whose leaves have `N` rows.
            timeout: Seconds to wait for room; `None` waits as long as it takes.
            priority: Replay only: one number for every row, or one per row (a length-`N`
                array, e.g. the rows' TD errors). Default: as `submit()`.
            stream: Sequence tables only: row `i` is a step of stream `stream + i` (default
                0), so a vector env of `N` envs is `N` streams.
            end_episode: Sequence tables only: a bool for every row, or a bool array of one
                per row (a vector env's `terminated`): the row's step ends its episode.
            truncated: Sequence tables only: as `end_episode`, for episodes cut short (a
                vector env's `truncated`).
            version: As `submit()`'s, for every row.

        Returns:
            `N`, the number of samples inserted.

        Raises:
            ValueError: The structure differs, a leaf lacks the leading dimension or has
                another shape, the leaves' `N` differ, a priority is invalid or not one per
                row, or `priority` was given to a FIFO server. Nothing is written.
            TypeError: A leaf is not an array (as for `submit()`) or has another dtype.
                Nothing is written.
            ServerClosedError: The server is (or gets) closed.
            TimeoutError: No room within `timeout`; if some rows went in, the message says
                how many (the first ones, in order).
        """
        if stream is None and end_episode is None and truncated is None and version is None:
            return self._core.submit_batch(batch, timeout, priority)
        first = None if stream is None else check_int("stream", stream, 0)
        return self._core.submit_batch(
            batch, timeout, priority, first, end_episode, truncated, version
        )

    def end_episode(self, stream: int = 0, *, truncated: bool = True) -> bool:
        """Sequence tables only: ends in-process stream `stream`'s open episode after its last
        step, as truncated (default) or terminated, as if that step had carried the flag (its
        last windows are made as `at_end` says). For a stream whose producer is gone.

        Returns:
            Whether the stream had an open episode.

        Raises:
            ValueError: The server has no `sequence=`, or `stream` is out of range.
        """
        if self._config.sequence is None:
            raise ValueError(
                "end_episode() needs a sequence table: Server(..., sequence=Sequence(length=...), "
                "sampler=..., max_size=...)"
            )
        first = check_int("stream", stream, 0)
        return self._core.end_stream(first, not check_bool("truncated", truncated))

    def sample(
        self,
        timeout: float | None = None,
        *,
        copy: bool = False,
        writable: bool = False,
        device: Any = None,
        layout: str | None = None,
        pad_to_multiple: int | None = None,
    ) -> Sample | None:
        """Waits for the next full batch and returns it, or `None` once the server is closed.

        Calling `sample()` gives the previous batch's slots back to the writers, so views from
        the previous call may show newer data from then on.

        Args:
            timeout: Seconds to wait; `None` waits as long as it takes.
            copy: Return private, writeable copies instead of read-only views into the ring.
            writable: Return writeable views into the ring (zero-copy, still only meaningful
                until the next `sample()`), for consumers that cannot take read-only memory:
                `torch.as_tensor`, `torch.from_numpy`, `jax.dlpack.from_dlpack`. The batch's
                slots are the learner's until the next `sample()`: writing into them before
                then is safe; after it, a write may garble a sample being written. The
                replay per-item arrays (`keys`, ...) stay read-only.
            device: Return the batch copied to this device, the copy complete: a torch device
                (`"cuda:0"`, `"cpu"`, a `torch.device`; torch tensors) or a JAX device
                (`jax.devices()[0]`; `jax.Array`s), as `dataset_iter(device=...)` does in
                the background. The copy is the caller's to keep. `copy` and `writable`
                make no difference then.
            layout: Ragged leaves only: this batch's layout (`"packed"` or `"padded"`)
                instead of the server's.
            pad_to_multiple: Ragged leaves only: this batch's `pad_to_multiple`.

        Raises:
            ImportError: `device` is not a JAX device and PyTorch is not installed.
            ValueError: `device` is not a CPU or CUDA device (torch).
            TimeoutError: No full batch arrived within `timeout`. With a replay sampler the
                message says what held the batch back: the rate limiter (its repr and its
                counters: inserts, samples, the limit) or a table with nothing to sample.
            KeyboardInterrupt: Ctrl-C while waiting.
        """
        if layout is not None or pad_to_multiple is not None:
            raise ValueError("layout and pad_to_multiple are for servers with echo.Ragged leaves")
        transfer = None if device is None else self._transfer_to(device)
        if transfer is not None:
            # A host device adopts a private copy; a GPU copies from writeable ring views.
            copy, writable = transfer.private, not transfer.private
        tally = self._tally
        started = tally.begin_wait()
        try:
            got = self._core.sample(timeout, copy, writable)
        except BaseException:
            tally.end_wait(started, None)
            raise
        if got is None:
            tally.end_wait(started, None)
            return None
        leaves, info, meta = got
        tally.end_wait(started, info.wait_ns)  # meta: the arrays `ServerCore.meta_names` names
        batch = self._layout.unflatten(leaves)
        extras: dict[str, Any] = dict(zip(self._meta_names, meta, strict=True))
        return Sample(batch if transfer is None else transfer.copy(batch), info, **extras)

    def _transfer_to(self, device: Any) -> Transfer:
        key = (type(device).__qualname__, repr(device))
        transfer = self._transfers.get(key)
        if transfer is None:
            transfer = self._transfers[key] = device_transfer(device)
        return transfer

    def update_priorities(self, keys: Any, priorities: Any) -> int:
        """Sets the priorities of the items with `keys` (from `Sample.keys`); the next batch
        is drawn with them. Keys no longer in the table (evicted or removed) are skipped and
        counted in `stats().unknown_keys_total`. Vectorised, GIL released.

        Args:
            keys: 1-D integer array-like (uint64).
            priorities: 1-D array-like of finite numbers >= 0, one per key.

        Returns:
            How many keys were skipped.

        Raises:
            TypeError: `keys` are not integers or `priorities` not numbers.
            ValueError: Shapes differ, a priority is negative, NaN or too large (naming its
                index; nothing is updated then), or the server is FIFO.
        """
        return self._core.update_priorities(keys_array(keys), priorities_array(priorities))

    def dataset_iter(
        self,
        *,
        copy: bool = False,
        timeout: float | None = None,
        writable: bool = False,
        device: Any = None,
        prefetch: int | None = None,
    ) -> Iterator[Sample]:
        """Yields batches until the server is closed.

        Args:
            copy: Yield private copies that stay valid forever (instead of views that are only
                meaningful until the next batch is requested).
            timeout: Seconds to wait for each batch, as `sample(timeout=...)`: the clock
                starts when the next batch is requested, so the time the loop body spends on
                a batch does not count. `None` (the default) waits as long as it takes.
            writable: Yield writeable views, as `sample(writable=True)`.
            device: A torch device (`"cuda:0"`, `"cpu"`, a `torch.device`): yield batches whose
                leaves are torch tensors on it, copied from the ring by a background thread
                (non-blocking copies on a side stream for CUDA; page-lock the ring with
                `pin_host_memory=True` for real DMA). Or a JAX device (`jax.devices()[0]`):
                leaves are `jax.Array`s committed to it (`jax.device_put`; on a CPU device
                from a private copy, since JAX may alias host memory). A batch's ring slots
                go back once its copy has completed, so the learner's step overlaps the next
                copy. With a replay sampler the batch is copied out of the table first (its
                per-item arrays must outlive the next draw).
            prefetch: How many copied batches the background thread keeps ready (default 2
                with `device`). Without `device` it needs `copy=True`: the thread then makes
                the private numpy copies in the background.

        With `device` or `prefetch`, every batch is still delivered once and in order; an
        error of the thread (a `TimeoutError`, a failed copy) is raised by the `next()` that
        would have returned the batch it failed on; leaving the loop (`break`, an exception,
        the iterator being closed or collected) or `close()` stops the thread and joins it.
        `timeout` then bounds each of the thread's waits for a batch.

        Raises:
            TimeoutError: No full batch arrived within `timeout` (the same message as
                `sample()`). It is raised from the `next()` that waited, which ends the
                iterator; nothing is lost (a replay batch's items drawn so far stay reserved),
                so a new `dataset_iter()` or `sample()` goes on where it stopped.
            ValueError: `timeout` is negative or NaN, `prefetch` is not a positive int, or
                `prefetch` without `device` and without `copy=True` (checked on the first
                `next()`).
            ImportError: A device other than a JAX one without PyTorch installed (on the
                first `next()`).
        """
        replay = self._core.max_size is not None
        yield from batches(self.sample, replay, copy, timeout, writable, device, prefetch)

    def publish(
        self, params: Any, version: int | None = None, *, compress: Codec | None = None
    ) -> int:
        """Publishes the learner's parameters to its workers: a pytree of numpy arrays, of
        the same structure, dtypes and shapes at every call (the first publish fixes them).
        Workers fetch them with `TcpClient.params()` and hear of each new version
        (`TcpClient.params_version`); over TCP they pull it in chunks of 1 MiB, and the server
        keeps at most two versions however many workers fetch. Publishing copies the arrays
        with the GIL released and never blocks `sample()` or the workers' inserts. A copy of
        the latest version is also kept for `checkpoint()` (their size once more in memory).

        Args:
            params: The parameters, e.g. `{"w": w, "b": b}` or a flax/haiku tree.
            version: The version to publish, above the latest; `None`: the latest plus one
                (the first is 1).
            compress: `echo.Zstd(level)` or `echo.Lz4()`: compress this version once, in
                chunks, for the workers that fetch over TCP (they decompress as they fetch;
                shared memory stays raw). For slow links; float weights shrink little.

        Returns:
            The version published.

        Raises:
            TypeError: A leaf is not a numpy array, or has another dtype than the first
                publish's (the message names the leaf).
            ValueError: Another structure or shape than the first publish's, or a version
                that is not above the latest. Nothing is published then.
        """
        return self._params.publish(params, version, compress)

    @property
    def params_version(self) -> int:
        """The latest version `publish()` published (0 before the first)."""
        return self._core.params_version

    def stats(self) -> SampleInfo:
        """The server's counters now, without sampling (`sequence` and `wait_ns` are 0)."""
        return self._core.stats()

    def reset_histograms(self) -> None:
        """Clears the timing histograms; counters keep counting."""
        self._core.reset_histograms()

    def close(self, *, drain: bool = False, restarting: bool = False) -> None:
        """Shuts down: a `sample()` blocked in another thread returns `None`, a blocked
        `submit()` raises `ServerClosedError`. Idempotent. Existing views stay readable.

        The TCP workers are told why before their connections close (protocol-2 clients;
        the notice follows the last acknowledgement, so every acknowledged sample was
        acknowledged before it). A plain `close()` is for good: their `send()` and `wait()`
        raise at once (`ServerClosedError` with `reconnect=True`, which then stops trying;
        `ConnectionClosedError` without), and `TcpClient.server_closing` says `"final"`.
        `restarting=True` says the learner comes back (a `Server.restore` on the same port,
        say): reconnecting workers keep trying for their `reconnect_timeout`. A learner that
        dies without `close()` (a crash, SIGKILL) says nothing, which workers treat as
        "maybe restarting". Under `echo.ray`, a plain `close()` also deregisters the shard
        (its workers move to another) and `restarting=True` keeps it registered.

        A plain `close()` drops what the learner has not been handed: samples acknowledged to
        workers but still queued in the ingress, and (FIFO) samples in the ring. Their number
        is `dropped_at_close` afterwards (and a warning is logged when it is not 0).

        Args:
            drain: Stop accepting and reading instead (every connection is closed, nothing
                more is acknowledged, `submit()` raises `ServerClosedError`), but keep handing
                out what was acknowledged: `sample()` and `dataset_iter()` go on returning full
                batches while the queued samples reach the ring, and the server closes for
                good when the ingress is empty and fewer than a batch remain (FIFO; a replay
                table closes once the ingress is empty). Then `sample()` returns `None` and
                `dropped_at_close` says how many were left (fewer than `batch_size`). Returns
                at once; call `close()` to stop draining early.

            restarting: Tell the workers the server comes back (see above).

        Stops the periodic checkpoints' thread and joins it (a checkpoint in progress
        completes, or fails and removes what it wrote; the wait is bounded).
        """
        hooks, self._close_hooks = self._close_hooks, []
        for hook in hooks:
            hook(restarting)
        periodic = self._periodic
        if periodic is not None:
            periodic.request_stop()
        self._core.close(drain, restarting)
        if periodic is not None:
            periodic.join(PERIODIC_JOIN_S)

    @property
    def dropped_at_close(self) -> int | None:
        """How many samples never reached the learner, counted when the server closed for
        good (`None` while it is open or draining): acknowledged samples still queued in the
        ingress, plus, for FIFO, samples committed to the ring but not handed out (after a
        drain: fewer than a batch). A replay table's items are not counted."""
        return self._core.dropped_at_close

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        # Leaving on an exception (a crash, Ctrl-C) is not a decision to stop for good: the
        # workers are told the learner may come back.
        self.close(restarting=exc_type is not None)

    def __repr__(self) -> str:
        return (
            f"Server(batch_size={self.batch_size}, {self._core.describe()}, "
            f"leaves={len(self._layout.leaves)}, closed={self.closed})"
        )


# `inspect.signature(Server)` (help(), IDEs, code that asks which arguments it takes) shows
# the constructor's arguments, not those of `__new__`, which only picks the class.
setattr(Server, "__signature__", ConstructorSignature())  # noqa: B010
