"""`echo.Server` when the example has ragged leaves: the same face over a ragged table.

`Server(example, ...)` builds a `RaggedServer` when a leaf of `example` is `echo.Ragged`
(`Server.__new__`). Workers send over TCP or a same-host shared-memory pipe (`echo.TcpClient`
with the same example). What a ragged server does not do yet (sequences, `writer()`, pinned
memory) raises `ValueError`, naming the argument, rather than being ignored.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, NoReturn

from echo import _ragged_checkpoint
from echo._echo import RaggedCore, SampleInfo
from echo._params import ParamsChannel
from echo._server_args import keys_array, periodic_args, priorities_array, versions_args
from echo._tally import Tally
from echo._validate import check_int
from echo.checkpoint import encode
from echo.compression import Lz4, Zstd
from echo.ragged import MAX_PAD_MULTIPLE, RaggedBuffer
from echo.replay import Fifo, MinSize, Prioritized, Remover, Uniform
from echo.sample import Sample
from echo.server import Server
from echo.transport import TcpTransport

__all__ = ["RaggedServer"]

_LATER = "a server with ragged leaves does not support {what} yet"


def _unsupported(what: str) -> NoReturn:
    raise ValueError(_LATER.format(what=what))


class RaggedServer(Server):
    """An `echo.Server` whose example has `echo.Ragged` leaves (see `Server`)."""

    _core: RaggedCore  # pyright: ignore[reportIncompatibleVariableOverride]

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
        sampler: Any = None,
        remover: Remover | None = None,
        max_size: int | None = None,
        rate_limiter: Any = None,
        max_times_sampled: int = 0,
        seed: int | None = None,
        sequence: Any = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: float | None = None,
        checkpoint_keep: int = 3,
        checkpoint_extra: Any = None,
        name: str = "default",
        compress: Any = None,
        max_bytes: int | None = None,
        policy_versions: bool = False,
        max_staleness: int | None = None,
        admission: str = "drop",
        batch_tokens: int | None = None,
        token_group: str | None = None,
        layout: str = "packed",
        pad_to_multiple: int = 1,
    ) -> None:
        del num_drainers, producer_queue_size
        versions = versions_args(policy_versions, max_staleness, admission)
        periodic = periodic_args(
            checkpoint_dir, checkpoint_every, checkpoint_keep, checkpoint_extra
        )
        if transport is not None and not isinstance(transport, TcpTransport):
            raise TypeError(
                f"transport must be a TcpTransport or None, got {type(transport).__name__}"
            )
        for what, given in (
            ("pin_host_memory=True", pin_host_memory),
            ("sequence=", sequence is not None),
            ("a remover other than Fifo()", remover is not None and not isinstance(remover, Fifo)),
        ):
            if given:
                _unsupported(what)
        if not isinstance(name, str) or not name:  # pyright: ignore[reportUnnecessaryIsInstance]
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        self._name = name
        # Plain ints from here on (a numpy integer is taken, and kept as an int: the
        # settings go into a checkpoint's JSON).
        batch_size = check_int("batch_size", batch_size, 1)
        num_buffers = check_int("num_buffers", num_buffers, 2)
        max_size = None if max_size is None else check_int("max_size", max_size, 1)
        max_bytes = None if max_bytes is None else check_int("max_bytes", max_bytes, 1)
        max_times_sampled = check_int("max_times_sampled", max_times_sampled, 0)
        seed = None if seed is None else check_int("seed", seed, 0)
        if batch_tokens is not None:
            batch_tokens = check_int("batch_tokens", batch_tokens, 1)
        pad_to_multiple = check_int("pad_to_multiple", pad_to_multiple, 1, MAX_PAD_MULTIPLE)
        self._buffer = RaggedBuffer(
            example,
            batch_size,
            num_buffers=num_buffers,
            sampler=sampler,
            max_size=max_size,
            max_bytes=max_bytes,
            rate_limiter=rate_limiter,
            max_times_sampled=max_times_sampled,
            seed=seed,
            batch_tokens=batch_tokens,
            token_group=token_group,
            layout=layout,
            pad_to_multiple=pad_to_multiple,
            compress=compress,
            policy_versions=versions["policy_versions"],
            max_staleness=versions["max_staleness"],
            admission=versions["admission"],
        )
        # `publish()`'s side, as `Server`'s: the parameters' structure checked, the version
        # published to the core (which serves it to the workers), a copy of the latest kept.
        self._params = ParamsChannel(self._buffer.core)
        self._batch_size = batch_size
        self._num_buffers = num_buffers
        self._sampler_arg = Fifo() if sampler is None else sampler
        self._max_bytes = max_bytes
        self._close_hooks = []
        self._transport: TcpTransport | None = transport
        self._tally = Tally()
        self._core = self._buffer.core  # what `Server.close` closes
        tree = self._buffer.layout
        self._core.set_reader(tree.flat_keys, tree.flatten)
        if type(self).submit is RaggedServer.submit:
            # The native method itself: a flat dict's leaves read by key, checked in Rust
            # (a Python frame in between cost more than the copy of a small sample).
            vars(self)["submit"] = self._core.submit
        self._periodic = None
        self._restored_extra = None
        # A restored checkpoint's TCP sessions, handed to the ingress when it starts.
        self._restored_sessions: list[tuple[bytes, int]] = []
        self._settings: dict[str, Any] = {
            "sampler": self._buffer.kind,
            "exponent": getattr(sampler, "exponent", None),
            "batch_size": batch_size,
            "num_buffers": num_buffers,
            "max_size": max_size,
            "max_bytes": max_bytes,
            "batch_tokens": batch_tokens,
            "token_group": token_group,
            "layout": layout,
            "compress": {
                name: {
                    "codec": type(codec).__name__,
                    "level": getattr(codec, "level", 0),
                    "force": codec.force,  # a float leaf's: restored with it
                }
                for name, codec in self.compress.items()
            },
            "pad_to_multiple": pad_to_multiple,
            "min_size": 1 if rate_limiter is None else rate_limiter.min_size,
            "max_times_sampled": max_times_sampled,
            "seed": seed,
            "name": name,
            "policy_versions": versions["policy_versions"],
            "max_staleness": versions["max_staleness"],
            "admission": versions["admission"],
        }
        if periodic is not None:
            self._start_periodic(periodic)
        self._transfers = {}

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str],
        example: Any = None,
        *,
        transport: TcpTransport | None = None,
        name: str | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: float | None = None,
        checkpoint_keep: int = 3,
    ) -> RaggedServer:
        """A new ragged server with the settings and entries of the checkpoint at `path`
        (`Server.restore` calls this for a ragged checkpoint): every entry inserted again in
        order, with its priority and draw count. `example` (default: rebuilt from the leaves'
        paths, dicts of str keys) must have the checkpoint's leaves. `checkpoint_dir`,
        `checkpoint_every` and `checkpoint_keep`: its periodic checkpoints, as `Server`'s
        (`echo.ray.shard_server` restores a shard with them)."""
        manifest, directory = _ragged_checkpoint.read(path)
        _ragged_checkpoint.verify(manifest, directory)  # before anything is loaded
        settings = dict(manifest["settings"])
        kind = settings.pop("sampler")
        exponent = settings.pop("exponent")
        sampler = {"fifo": Fifo(), "uniform": Uniform()}.get(kind) or Prioritized(exponent)
        min_size = settings.pop("min_size")
        saved_name = settings.pop("name")
        batch_size = settings.pop("batch_size")
        codecs = {
            name: Zstd(spec["level"], force=spec.get("force", False))
            if spec["codec"] == "Zstd"
            else Lz4(force=spec.get("force", False))
            for name, spec in settings.pop("compress", {}).items()
        }
        settings["compress"] = codecs or None
        published = int(settings.pop("params_version", 0))
        server = RaggedServer(
            _ragged_checkpoint.example_of(manifest) if example is None else example,
            batch_size,
            transport,
            sampler=sampler,
            rate_limiter=None if kind == "fifo" else MinSize(min_size),
            name=saved_name if name is None else name,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            checkpoint_keep=checkpoint_keep,
            **settings,
        )
        try:
            # Before the entries go in: the bound judges them by the same version. The
            # parameters are published again (workers fetch them as before); a version
            # published without them (none kept) is recorded alone.
            server._params.restore(_ragged_checkpoint.read_params(manifest, directory))
            if published > server.params_version:
                server._buffer.core.publish_version(published)
            _ragged_checkpoint.refill(server, manifest, directory)
            server._restored_extra = _ragged_checkpoint.read_extra(manifest, directory)
            server._restored_sessions = _ragged_checkpoint.sessions_of(manifest, directory)
        except BaseException:
            server.close()
            raise
        return server

    # --- what a ragged server does -------------------------------------------------------

    def submit(  # pyright: ignore[reportIncompatibleMethodOverride]
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
        """Copies one sample in: its ragged leaves `(n, *inner_shape)` with `n <= max_len`,
        equal `n` within a length group. See `Server.submit`."""
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
        """See `Server.submit_group`; `version`: the policy version of every sample of the
        group (a server that keeps versions; default the latest published)."""
        self._buffer.submit_group(samples, timeout, priority, version)

    def sample(  # pyright: ignore[reportIncompatibleMethodOverride]
        self,
        timeout: float | None = None,
        *,
        copy: bool = False,
        writable: bool = False,
        device: Any = None,
        layout: str | None = None,
        pad_to_multiple: int | None = None,
    ) -> Sample | None:
        """See `Server.sample`; ragged leaves come as `echo.Packed` or `echo.Padded`."""
        del writable  # copies are writeable already; views of the arena stay read-only
        started = self._tally.begin_wait()
        try:
            batch = self._buffer.sample(
                timeout, layout, pad_to_multiple, copy or device is not None
            )
        except BaseException:
            self._tally.end_wait(started, None)
            raise
        self._tally.end_wait(started, None if batch is None else batch.info.wait_ns)
        if batch is None or device is None:
            return batch
        return batch._with_batch(self._transfer_to(device).copy(batch.batch))  # pyright: ignore[reportPrivateUsage]

    def dataset_iter(  # pyright: ignore[reportIncompatibleMethodOverride]
        self,
        *,
        copy: bool = False,
        timeout: float | None = None,
        writable: bool = False,
        device: Any = None,
        prefetch: int | None = None,
    ) -> Iterator[Sample]:
        """Yields batches until the server is closed (see `Server.dataset_iter`)."""
        del writable
        if prefetch is not None:
            _unsupported("prefetch=")
        while (batch := self.sample(timeout, copy=copy, device=device)) is not None:
            yield batch

    def update_priorities(self, keys: Any, priorities: Any) -> int:
        """Sets the priorities of the entries `keys` name (from `Sample.keys`: a group's
        samples share its key, and one priority; a key given twice takes the last), as
        `Server.update_priorities`: 1-D integer keys, 1-D finite priorities >= 0, one per
        key; keys no longer in the table (evicted, removed) are skipped. Returns how many
        were skipped, as any server's."""
        keys = keys_array(keys)
        updated = self._buffer.core.update_priorities(keys, priorities_array(priorities))
        return len(keys) - updated

    def stats(self) -> SampleInfo:
        return self._buffer.stats({})

    # --- settings -------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def num_buffers(self) -> int | None:
        return self._num_buffers if self._buffer.kind == "fifo" else None

    @property
    def max_size(self) -> int | None:
        return self._buffer.capacity if self._buffer.kind != "fifo" else None

    @property
    def capacity(self) -> int:
        return self._buffer.capacity

    @property
    def max_bytes(self) -> int | None:
        return self._max_bytes

    @property
    def sampler(self) -> Any:
        return self._sampler_arg

    @property
    def closed(self) -> bool:
        return self._buffer.core.closed

    @property
    def leaf_names(self) -> list[str]:
        return [leaf.name for leaf in self._buffer.layout.leaves]

    @property
    def batch_tokens(self) -> int | None:
        """The token budget (rows of `token_group` per batch), or `None`."""
        tokens = self._buffer.batch_tokens
        return None if tokens is None else tokens[1]

    @property
    def num_drainers(self) -> int:
        """0: a ragged server serves each TCP connection on a thread of its own."""
        return 0

    @property
    def producer_queue_size(self) -> int:
        """0: a ragged server has no connection queues (a connection inserts directly)."""
        return 0

    @property
    def transport(self) -> TcpTransport | None:
        return self._transport

    @property
    def port(self) -> int | None:
        return self._buffer.core.port

    @property
    def compress(self) -> dict[str, Any]:
        """The leaves stored compressed, by path (keys joined by `/`, as any server names
        them), and their codecs."""
        leaves = self._buffer.layout.leaves
        return {
            leaf.key: codec
            for leaf, codec in zip(leaves, self._buffer.codecs, strict=True)
            if codec is not None
        }

    @property
    def sequence(self) -> None:
        return None

    @property
    def pinned(self) -> bool:
        return False

    @property
    def params_version(self) -> int:
        """The latest version `publish()` published (0 before the first)."""
        return self._buffer.core.params_version

    @property
    def restored_extra(self) -> Any:
        """The learner's state of the checkpoint this server was restored from (`extra=`),
        or None."""
        return self._restored_extra

    @property
    def dropped_at_close(self) -> int | None:
        return None

    def reset_histograms(self) -> None:
        """Nothing to reset: a ragged server keeps no histograms."""

    # --- not yet --------------------------------------------------------------------------

    def start(self) -> None:
        """Starts listening for workers (`echo.TcpClient` with the same ragged example) on
        the transport's port, if it has one; see `Server.start`. One thread per connection;
        a worker on this host sends through a shared-memory pipe unless the transport or the
        worker turns it off (`shared_memory=False`), and a few threads serve every pipe."""
        transport = self._transport
        if transport is None or self._buffer.core.port is not None:
            return
        token = transport.token or os.environ.get("ECHO_TOKEN") or None
        self._buffer.core.start_tcp(
            transport.host,
            transport.port,
            None if token is None else token.encode(),
            transport.max_connections,
            transport.max_buffered_bytes,
            transport.shared_memory,
            transport.session_timeout,
            self._restored_sessions,
            transport.heartbeat_timeout,
        )

    def writer(self, *, timeout: float | None = None) -> NoReturn:  # pyright: ignore[reportIncompatibleMethodOverride]
        _unsupported("writer()")

    def submit_batch(self, *args: Any, **kwargs: Any) -> NoReturn:  # pyright: ignore[reportIncompatibleMethodOverride]
        _unsupported("submit_batch() (use submit() or submit_group())")

    def end_episode(self, stream: int = 0, *, truncated: bool = True) -> NoReturn:  # pyright: ignore[reportIncompatibleMethodOverride]
        _unsupported("end_episode()")

    def checkpoint(self, path: str | os.PathLike[str], *, extra: Any = None) -> None:
        """Writes every stored entry (oldest first; FIFO: those not handed out yet) with its
        priority and draw count, and the settings, to `path`: numpy files of each leaf's
        values plus a ragged leaf's offsets, and `ragged.json` (see `echo._ragged_checkpoint`).
        `path` becomes a symbolic link replaced atomically. Inserts and sampling wait while
        the entries are copied. `Server.restore(path)` rebuilds the server.

        `extra`: the learner's own state, as for `Server.checkpoint` (a tree of dicts, lists
        and tuples whose leaves are numpy arrays, numpy scalars or JSON values), written in
        the same directory and so replaced with the data; `restored_extra` and
        `echo.checkpoint.read_extra(path)` give it back. The latest published parameters
        (`publish()`) go with it: a restored server publishes them again with their version,
        so its workers fetch what they fetched before (`echo.checkpoint.read_params(path)`
        reads them alone).

        Raises:
            TypeError: A node of `extra` is not one of those kinds (nothing is written).
            FileExistsError: `path` exists and is not a checkpoint link.
            OSError: Writing failed (nothing at `path` changed then).
        """
        encoded = encode(extra, self._params.latest())
        try:
            _ragged_checkpoint.write(self, path, self._settings, encoded)
        except BaseException:
            self._tally.checkpoint_failures += 1
            raise
        self._tally.checkpoints += 1

    def publish(self, params: Any, version: int | None = None, *, compress: Any = None) -> int:
        """Publishes a new version of the learner's parameters, as `Server.publish`:
        workers fetch it with `TcpClient.params()` (over their connection, in chunks) and
        hear of each version at once (`params_version`); with `max_staleness`, samples are
        judged by it from now on. `compress`: compress the version once for the fetches.

        Returns:
            The version published.

        Raises:
            TypeError: A leaf is not a numpy array, or has another dtype than the first
                publish's.
            ValueError: Another structure or shape than the first publish's, or a version
                not above the latest.
        """
        return self._params.publish(params, version, compress)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        leaves = ", ".join(self.leaf_names)
        tokens = f", batch_tokens={self.batch_tokens}" if self.batch_tokens else ""
        return (
            f"Server(ragged, {self._sampler_arg!r}, batch_size={self._batch_size}{tokens}, "
            f"leaves=[{leaves}], {state})"
        )
