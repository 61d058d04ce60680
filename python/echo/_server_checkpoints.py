"""`Server`'s checkpoints: `checkpoint()`, `restore()`, `restored_extra` and the periodic
checkpointer, in a base class of `Server` (the learner's checkpoints are one responsibility;
sampling and inserting are another)."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from echo import _ragged_checkpoint
from echo import checkpoint as _checkpoint
from echo._periodic import PeriodicCheckpointer
from echo._server_args import Periodic, periodic_args, recorded_compress, restored_settings
from echo.compression import Compress
from echo.replay import RateLimiter, Remover, Sampler, Sequence

if TYPE_CHECKING:
    from echo._echo import ServerCore
    from echo._params import ParamsChannel
    from echo._tally import Tally
    from echo.server import Server


class Checkpoints:
    """What `Server` does with checkpoints (its documentation shows these as its own)."""

    # Set by `Server.__init__`.
    _core: ServerCore
    _tally: Tally
    _params: ParamsChannel
    _restored_extra: Any
    _periodic: PeriodicCheckpointer | None

    def _start_periodic(self, args: Periodic) -> None:
        ref = weakref.ref(self)
        extra = args.extra

        def checkpoint(path: str) -> bool:
            server = ref()  # not `self`: the thread must not keep the server alive
            if server is None or server._core.closed:
                return False
            server.checkpoint(path, extra=None if extra is None else extra())
            return True

        periodic = PeriodicCheckpointer(checkpoint, args.directory, args.every, args.keep)
        try:
            periodic.start()
        except BaseException:
            self._core.close()
            raise
        self._periodic = periodic

    def checkpoint(self, path: str | os.PathLike[str], *, extra: Any = None) -> None:
        """Writes a consistent snapshot of the server to the directory `path` while inserts
        and `sample()` go on, and with `extra` the learner's own state beside it.

        Replay: every item's data, key, priority and times-sampled count in insertion order,
        the rate limiter's counters, the sampler's RNG state, the next key and the settings:
        `Server.restore(path)` rebuilds a server that samples, evicts, paces and numbers new
        items as this one would have. Inserts still being copied when the snapshot is taken
        are not in it (their samples are still in the ingress, see below, or were submitted
        by a `submit()` that had not returned). Inserts and `sample()` wait at most for one
        ~1 MiB chunk's copy at a time.

        Sequence tables: every stored step (each step once), the windows with their keys,
        priorities and times sampled, the streams and their open episodes, the limiter's
        counters, the RNG state and the settings; the steps' bytes are copied a chunk at a
        time while inserts and sampling go on (copy-on-write for chunks a writer takes).

        FIFO: every committed sample not yet handed to the learner, in order, the partial
        batch included (`batch_size` and `num_buffers` are the settings). Writers are held
        back only for the moment the snapshot takes (the copies already under way finish),
        and then only from ring slots the checkpoint has not copied yet: at worst they wait
        for room, the learner never does.

        Both also hold the samples acknowledged to TCP clients but still queued in the
        ingress at the snapshot's moment (FIFO: after the ring's, in order), so that a
        checkpoint plus a restart loses no acknowledged sample; the manifest's
        `counts.from_ingress` says how many.

        `path` becomes a symbolic link to a sibling directory (`.<name>.ckpt-<token>`) that
        holds `manifest.json` and one `.npy` file per leaf (replay: plus `keys.npy`,
        `priorities.npy`, `times_sampled.npy` and the ingress's samples in `ingress_*.npy`);
        `np.load(..., mmap_mode="r")` opens them. The replacement is atomic: a process killed
        at any point leaves `path` at the previous complete checkpoint or the new one. One
        writer per `path` at a time.

        The manifest also records the settings that are not part of the data
        (`num_drainers`, `producer_queue_size`), which `restore()` keeps unless told others.
        The latest version `publish()` published is stored too (its version and leaves, with
        the extra's files); `restore()` publishes it again with that version.

        Args:
            path: Where the checkpoint goes (a new path, or a checkpoint link to replace).
            extra: The learner's own state, stored in the same directory and so replaced
                atomically with the data: a tree of dicts (str keys), lists and tuples whose
                leaves are numpy arrays, numpy scalars, or JSON values (None, bool, int,
                float, str), e.g. `{"params": {...}, "opt_state": {...}, "step": 1200}`.
                `Server.restore(path)` gives it back as `restored_extra`;
                `echo.checkpoint.read_extra(path)` reads it alone. It is written after the
                data's snapshot, from the arrays as they are while `checkpoint()` runs: do not
                modify them in another thread meanwhile. `None`: no extra.

        Raises:
            TypeError: A node of `extra` is not one of the kinds above (a torch tensor, a
                dataclass, an object array, a dict with a non-str key); the message names its
                path in the tree (`extra['opt'][1]`). Nothing is written then.
            FileExistsError: `path` exists and is not a checkpoint link (a non-empty
                directory or a file).
            RuntimeError: Another checkpoint of this server is being written.
            OSError: Writing failed (nothing at `path` changed then).
        """
        try:
            self._write_checkpoint(path, extra)
        except BaseException:
            self._tally.checkpoint_failures += 1
            raise
        self._tally.checkpoints += 1

    def _write_checkpoint(self, path: str | os.PathLike[str], extra: Any) -> None:
        encoded = _checkpoint.encode(extra, self._params.latest())
        _checkpoint.write(self._core, path, encoded)

    @classmethod
    def restore(
        cls,
        path: str | os.PathLike[str],
        example: Any = None,
        *,
        transport: Any = None,
        num_buffers: int | None = None,
        num_drainers: int | None = None,
        producer_queue_size: int | None = None,
        pin_host_memory: bool = False,
        batch_size: int | None = None,
        sampler: Sampler | None = None,
        remover: Remover | None = None,
        max_size: int | None = None,
        rate_limiter: RateLimiter | None = None,
        max_times_sampled: int | None = None,
        sequence: Sequence | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: float | None = None,
        checkpoint_keep: int = 3,
        checkpoint_extra: Callable[[], Any] | None = None,
        name: str | None = None,
        compress: Compress = None,
        max_bytes: int | None = None,
    ) -> Server:
        """A new server with the contents and settings of the checkpoint at `path` (written
        by `checkpoint()`).

        Replay: the same items (data, keys, priorities, times sampled, insertion order), rate
        limiter counters, RNG state, next key, batch size, sampler, remover, rate limiter,
        `max_size` and `max_times_sampled`. FIFO: the same `batch_size` and `num_buffers`,
        and the checkpoint's samples in the ring in the same order, so that `sample()` hands
        them out first. Sequence tables: the same steps, windows (keys included), priorities,
        limiter counters and settings (`sequence=` too); in-process streams go on with their
        open episodes (the next `submit(step, stream=k)` continues stream `k`'s), and the
        streams of TCP clients end theirs, truncated, after the steps their connections had
        queued: a client that comes back is a new stream.

        The samples the checkpoint took from the ingress go in (after the replay items,
        after the FIFO ring's samples) before anything new: as many as fit at once, the rest
        from a background thread as `sample()` makes room; `submit()` and the transport's
        inserts wait for them.

        Settings. Those that are part of the data (`batch_size`, `max_size`, `sampler`,
        `remover`, `rate_limiter`, `max_times_sampled`, `sequence`) are the checkpoint's:
        the restored server continues the recorded sampling (its RNG state, its limiter's
        counters, a FIFO ring's batches), which another value would silently change, so
        passing one is only a check, and a different value raises `ValueError`. The rest
        tune the server and do not touch the data: `num_drainers`,
        `producer_queue_size`, `compress`, `max_bytes` and `name` are recorded in the
        checkpoint and kept unless given here
        (checkpoints written before they were recorded restore with the defaults);
        `num_buffers` (FIFO) is the checkpoint's unless given (samples that do not fit a
        smaller ring at once go in as `sample()` makes room); `transport`, `pin_host_memory`
        and the periodic checkpoint settings belong to the process, not to the data, and are
        never taken from the checkpoint. The seed is not an argument: the checkpoint holds the
        sampler's RNG state, which a restore continues.

        The checkpoint's `extra` (the learner's state, see `checkpoint()`) is
        `restored_extra` on the new server: read from the same directory as the data, so the
        two belong together even while periodic checkpoints replace `path`. Parameters the
        checkpointed server had published are published again with their version (workers
        fetch them, `params_version` says it); the next `publish()` must have their leaves.

        Like the constructor, it returns a server that is not started: call `start()` (or use
        `with`) to bind `transport`; `submit()` and `sample()` work at once.

        Every file is checked against the manifest's size and SHA-256 before anything is
        loaded, so nothing is half-restored.

        Args:
            path: The checkpoint (the link `checkpoint()` made, or a copy of its directory).
            example: A pytree that must match the checkpoint's layout (structure, dtypes,
                shapes). `None` rebuilds the example from the manifest, which works for trees
                of dicts with str keys (pass `example` for tuples, lists or namedtuples).
            transport: As the constructor's.
            num_buffers: FIFO only: the ring's batches; `None` keeps the checkpoint's.
            num_drainers: As the constructor's; `None` keeps the checkpoint's (default 8).
            producer_queue_size: As the constructor's; `None` keeps the checkpoint's (the
                automatic size if the checkpoint's server had it).
            pin_host_memory: As the constructor's.
            batch_size: Checked against the checkpoint's (see Settings above).
            sampler: Checked against the checkpoint's.
            remover: Checked against the checkpoint's.
            max_size: Checked against the checkpoint's.
            rate_limiter: Checked against the checkpoint's.
            max_times_sampled: Checked against the checkpoint's.
            sequence: Checked against the checkpoint's.
            checkpoint_dir: As the constructor's; periodic checkpoints start once the
                contents are restored.
            checkpoint_every: As the constructor's.
            checkpoint_keep: As the constructor's.
            checkpoint_extra: As the constructor's.
            name: As the constructor's; `None` keeps the checkpoint's (`"default"` for a
                checkpoint written before names were recorded), so the restored server's
                metrics keep their `server` label.
            compress: As the constructor's; `None` keeps the checkpoint's (`{}` stores every
                leaf raw). The checkpoint's rows are raw, so any codec may be chosen.
            max_bytes: As the constructor's; `None` keeps the checkpoint's.

        Raises:
            CheckpointError: (a `ValueError`) a file is missing, truncated or corrupted, the
                format version is newer than this echo reads, or `example` does not match;
                the message names the file.
            ValueError: A setting that is part of the data differs from the checkpoint's, or
                does not apply to its kind (`max_size` for a FIFO checkpoint, `num_buffers`
                for a replay one); the message names the setting, the checkpoint's value and
                the one given. Or a tuning setting is out of range, as in the constructor.
            TypeError: An argument has the wrong type, as in the constructor.
        """
        if _ragged_checkpoint.is_ragged(path):
            from echo._ragged_server import RaggedServer

            return RaggedServer.from_checkpoint(  # pyright: ignore[reportReturnType]
                path,
                example,
                transport=transport,
                name=name,
                checkpoint_dir=checkpoint_dir,
                checkpoint_every=checkpoint_every,
                checkpoint_keep=checkpoint_keep,
            )
        periodic = periodic_args(
            checkpoint_dir, checkpoint_every, checkpoint_keep, checkpoint_extra
        )
        opened, example = _checkpoint.open_for_restore(path, example)
        kwargs = restored_settings(
            opened,
            {
                "batch_size": batch_size,
                "sampler": sampler,
                "remover": remover,
                "max_size": max_size,
                "rate_limiter": rate_limiter,
                "max_times_sampled": max_times_sampled,
                "sequence": sequence,
            },
            os.fspath(path),
        )
        if num_buffers is not None:
            if opened.kind != "fifo":
                raise ValueError(
                    f"restore(): num_buffers={num_buffers!r} does not apply: the checkpoint at "
                    f"{os.fspath(path)} is {opened.kind_description} (num_buffers sizes the "
                    "FIFO ring)"
                )
            kwargs["num_buffers"] = num_buffers
        tuning = opened.tuning()
        server = cast("type[Server]", cls)(
            example,
            transport=transport,
            num_drainers=tuning.get("num_drainers", 8) if num_drainers is None else num_drainers,
            producer_queue_size=tuning.get("producer_queue_size")
            if producer_queue_size is None
            else producer_queue_size,
            pin_host_memory=pin_host_memory,
            name=tuning.get("name", "default") if name is None else name,
            compress=recorded_compress(example, tuning) if compress is None else compress,
            max_bytes=tuning.get("max_bytes") if max_bytes is None else max_bytes,
            policy_versions=opened.policy_versions,
            max_staleness=tuning.get("max_staleness"),
            admission=tuning.get("admission", "drop"),
            **kwargs,
        )
        try:
            server._core._restore(opened)  # pyright: ignore[reportPrivateUsage]
            server._restored_extra = _checkpoint.restored_extra(opened)  # pyright: ignore[reportPrivateUsage]
            server._params.restore(_checkpoint.restored_params(opened))  # pyright: ignore[reportPrivateUsage]
        except BaseException:
            server.close()
            raise
        # The exported counters of the new process start at 0, as any restarted process's
        # do (Prometheus' rate() and increase() handle such a reset); stats() keeps the
        # totals the checkpoint carried over.
        server._tally.restarted(server.stats())  # pyright: ignore[reportPrivateUsage]
        if periodic is not None:
            server._start_periodic(periodic)  # pyright: ignore[reportPrivateUsage]
        return server

    @property
    def restored_extra(self) -> Any:
        """The `extra` of the checkpoint this server was restored from (see `checkpoint()`):
        the learner's state, read from the same checkpoint directory as the data. `None` for
        a server built by the constructor, or restored from a checkpoint without one. Arrays
        are in memory (not memory-mapped), so they outlive the checkpoint's files."""
        return self._restored_extra
