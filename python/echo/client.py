"""The rollout-worker side: `TcpClient` streams samples to a `Server`'s `TcpTransport`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

if TYPE_CHECKING:
    from typing_extensions import Self

from echo._echo import TcpSender
from echo._params import layout_of_description, param_sizes, param_tree
from echo._pytree import TreeLayout
from echo._validate import (
    ConstructorSignature,
    check_bool,
    check_int,
    check_seconds,
    check_token,
)
from echo.compression import Codec

__all__ = ["TcpClient"]

_log = logging.getLogger("echo")


@dataclass(frozen=True)
class _ClientSettings:
    """A `TcpClient`'s settings, their types checked, as the native `TcpSender` reads them
    (which checks their values: `protocol` is the user's `"auto"`, 1 or 2)."""

    max_inflight: int
    connect_timeout: float
    protocol: object
    token: str | None
    reconnect_timeout: float | None  # None: no reconnection
    heartbeat_timeout: float | None
    shared_memory: bool | None
    dial_timeout: float | None
    name: str | None
    wire_compression: bool
    durable_bytes: int | None  # None: plain acknowledgements


class TcpClient:
    """Sends samples to an echo server over TCP (wire-compatible with id-echo 0.2.1).

    Connecting negotiates the wire protocol and checks that the server stores samples shaped
    like `data_sample`: with protocol 2 (echo servers) every leaf's dtype, name and shape,
    with protocol 1 (id-echo 0.2.1 servers) element sizes and shapes. Each `send()` writes
    the sample's leaves straight from their numpy buffers (one vectored write, no joined
    copy). At most `max_inflight_msgs` samples are in flight unacknowledged; `send()` blocks
    (GIL released, Ctrl-C honoured) beyond that.

    Args:
        host: Server host name or address.
        port: Server port.
        data_sample: A pytree like the server's example (same structure, shapes and dtypes).
        max_inflight_msgs: Unacknowledged samples allowed before `send()` blocks.
        connect_timeout: Seconds to wait for the connection and the handshake (with
            `reconnect=True`: for each attempt at the first connection, see `reconnect`).
        protocol: `"auto"` (protocol 2 when the server offers it, else 1), `1` (as id-echo
            0.2.1: no priorities, token, reconnection or heartbeats) or `2` (refuse servers
            that do not speak it). See the TCP guide for when "auto" can pick 1 wrongly.
        token: The shared secret the server requires (`TcpTransport(token=...)`); `None`
            reads the environment variable `ECHO_TOKEN` (unset or empty: no token). A client
            with a token speaks only protocol 2 and refuses a server that cannot prove it
            knows the same token.
        reconnect: When the connection drops, reconnect (exponential backoff with jitter) for
            up to `reconnect_timeout` seconds and resend every sample not yet acknowledged;
            the server stores each exactly once when it is the same server process. `send()`
            and `wait()` block meanwhile. Keeps a copy of each unacknowledged sample.
            Protocol 2 only. The first connection is retried too: a worker started before
            its learner listens (connection refused, reset, or closed during the handshake)
            tries again with the same backoff for up to `max(connect_timeout,
            reconnect_timeout)` seconds, then raises `TimeoutError` naming the address and
            the last error. Errors another attempt would only repeat (a layout, token or
            protocol refusal) are raised at once.
        reconnect_timeout: Seconds to keep trying after a drop before `ConnectionClosedError`.
        heartbeat_timeout: Seconds the server may stay silent (protocol 2 servers send
            heartbeats) before the connection is taken for dead; `None` never.
        shared_memory: The same-host shared-memory path (Linux, protocol 2): each sample is
            written straight into a ring in shared memory that the learner copies from once,
            the TCP connection staying open for liveness. `None` (the default) uses it when
            the server offers it (the learner runs on this machine under the same user) and
            falls back to TCP silently otherwise (a debug log says why); `False` always sends
            over TCP; `True` requires it and raises `SharedMemoryError` saying why when it
            cannot be had. With `reconnect=True` each new connection asks again, and what
            the learner had not taken is resent over whichever path the new connection has.
            Which path is in use: `transport_path`.
        name: How this client names itself in the log lines of the `"echo"` logger (a
            reconnecting worker's warning reads `name (host:port): connection lost ...`);
            `None`: the server's address alone.
        wire_compression: Compress the leaves the server asks for (its `compress=`) before
            sending them over TCP (protocol 2; never over shared memory, which copies raw):
            fewer bytes on a network link, some CPU on this worker. `False` sends every leaf
            raw. Which leaves a connection compresses: `wire_compression_leaves`.
        durable: Durable acknowledgements (protocol 2, over TCP; turns `reconnect` on): every
            sample is kept until the learner says a checkpoint it completed holds it, not
            only until it is acknowledged. A learner killed at any moment and restored from
            its latest checkpoint (`Server.restore` on the same address) tells this client
            where its checkpoint stands, and the client resends from there: the restored
            learner ends with exactly the samples sent, none lost, none twice. The learner
            must checkpoint (`checkpoint_every=`): what is not yet persisted stays here,
            and `send()` blocks once it fills `durable_bytes` (counted in `durable_waits`).
            `close()` waits for the last samples to be persisted. Over TCP and shared memory.
        durable_bytes: The most bytes of samples kept until persisted (default 256 MiB); a
            sample larger than this is kept alone.
        params_example: A pytree like the parameters the learner publishes
            (`Server.publish`): same structure, dtypes and shapes; `params()` returns them in
            that structure. `None` (default): `params()` learns the structure from the
            learner once, as nested dicts (str keys) and lists (sequences) of arrays.

    Raises:
        ValueError: The server is not an echo server, speaks only protocol 1 with
            `protocol=2`, or stores samples of another layout (the message names the leaf,
            what the server expects and what `data_sample` has).
        PermissionError: A token problem: the server requires one and there is none, the
            token is wrong, or the server cannot prove this client's token.
        ConnectionClosedError: The server closed the connection during the handshake (for
            example, because it is at `max_connections`).
        SharedMemoryError: `shared_memory=True` and the server did not offer shared memory
            (another host, protocol 1, `TcpTransport(shared_memory=False)`, not Linux, the
            learner's segments already hold half of its `max_buffered_bytes`) or it could not
            be attached; also with `protocol=1`.
        OSError: Connecting failed (e.g. `ConnectionRefusedError`; with `reconnect=True`,
            `TimeoutError` once retrying the first connection ran out of time).
    """

    def __new__(  # pyright: ignore[reportInconsistentConstructor]
        cls, host: str = "", port: int = 0, data_sample: Any = None, *args: Any, **kwargs: Any
    ) -> Self:
        """A `RaggedTcpClient` when `data_sample` has `echo.Ragged` leaves."""
        from echo._ragged_client import RaggedTcpClient
        from echo.ragged import has_ragged_leaves

        if cls is TcpClient and has_ragged_leaves(data_sample):
            return cast("Self", object.__new__(RaggedTcpClient))
        return object.__new__(cls)

    def __init__(  # pyright: ignore[reportInconsistentConstructor]
        self,
        host: str,
        port: int,
        data_sample: Any,
        max_inflight_msgs: int = 32,
        *,
        connect_timeout: float = 10.0,
        protocol: Literal["auto", 1, 2] = "auto",
        token: str | None = None,
        reconnect: bool = False,
        reconnect_timeout: float = 60.0,
        heartbeat_timeout: float | None = 10.0,
        shared_memory: bool | None = None,
        name: str | None = None,
        wire_compression: bool = True,
        durable: bool = False,
        durable_bytes: int = 256 * 2**20,
        params_example: Any = None,
    ) -> None:
        self._open(
            host,
            port,
            data_sample,
            max_inflight_msgs,
            connect_timeout=connect_timeout,
            protocol=protocol,
            token=token,
            reconnect=reconnect,
            reconnect_timeout=reconnect_timeout,
            heartbeat_timeout=heartbeat_timeout,
            shared_memory=shared_memory,
            name=name,
            wire_compression=wire_compression,
            durable=durable,
            durable_bytes=durable_bytes,
            params_example=params_example,
        )

    def _open(
        self,
        host: str,
        port: int,
        data_sample: Any,
        max_inflight_msgs: int,
        *,
        connect_timeout: float,
        protocol: Literal["auto", 1, 2],
        token: str | None,
        reconnect: bool,
        reconnect_timeout: float,
        heartbeat_timeout: float | None,
        shared_memory: bool | None,
        name: str | None,
        wire_compression: bool = True,
        durable: bool = False,
        durable_bytes: int = 256 * 2**20,
        params_example: Any = None,
        dial_timeout: float | None = None,
        resolver: Callable[[tuple[str, int, str] | None], tuple[str, int] | None] | None = None,
    ) -> None:
        """Checks the settings and connects (the constructor's body). `resolver` and
        `dial_timeout` are for clients that find their server elsewhere (`echo.ray`): asked
        before every connection attempt, and the first connection's deadline."""
        max_inflight_msgs = check_int("max_inflight_msgs", max_inflight_msgs, 1, 2**32 - 1)
        reconnect = check_bool("reconnect", reconnect)
        token = check_token("token", token)
        timeout = check_seconds("reconnect_timeout", reconnect_timeout, optional=False)
        heartbeat = check_seconds("heartbeat_timeout", heartbeat_timeout, optional=True)
        if shared_memory is not None:
            shared_memory = check_bool("shared_memory", shared_memory)
        wire_compression = check_bool("wire_compression", wire_compression)
        durable = check_bool("durable", durable)
        durable_bytes = check_int("durable_bytes", durable_bytes, 1, 2**63 - 1)
        if durable:
            reconnect = True
        if name is not None and not isinstance(name, str):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(f"name must be a str or None, got {type(name).__name__}")
        connect = check_seconds("connect_timeout", connect_timeout, optional=False)
        assert connect is not None
        assert timeout is not None
        if dial_timeout is None and reconnect:
            dial_timeout = max(connect, timeout)
        settings = _ClientSettings(
            max_inflight=max_inflight_msgs,
            connect_timeout=connect,
            protocol=protocol,
            token=token,
            reconnect_timeout=timeout if reconnect else None,
            heartbeat_timeout=heartbeat,
            shared_memory=shared_memory,
            dial_timeout=dial_timeout,
            name=name,
            wire_compression=wire_compression,
            durable_bytes=durable_bytes if durable else None,
        )
        self._layout = TreeLayout(data_sample)
        self._params_layout = None if params_example is None else TreeLayout(params_example)
        self._sender = TcpSender(host, port, self._layout, settings, resolver)
        self._closed = False
        self._durable = durable
        self._given_up: int | None = None
        self._name = name

    def send(
        self,
        sample: Any,
        *,
        timeout: float | None = None,
        priority: float | None = None,
        end_episode: bool = False,
        truncated: bool = False,
        version: int | None = None,
    ) -> None:
        """Sends one sample: to a sequence table, one step of this client's stream.

        Args:
            sample: A pytree with `data_sample`'s structure, shapes and dtypes.
            timeout: Seconds to wait for room in the in-flight window (or for a reconnect);
                `None` waits as long as it takes.
            priority: The new item's priority on a replay server (protocol 2); `None` gives
                it the table's default (the largest priority seen so far). To a sequence
                table, the step's priority (a window gets the largest of its steps').
            end_episode: Sequence tables only: the step is its episode's last (terminated).
            truncated: Sequence tables only: the step is its episode's last, cut short (a
                time limit) rather than terminated.
            version: To a learner that keeps policy versions: the version of the parameters
                that made the sample. `None`: `policy_version` (the newest `params()` got).
                Ignored by a learner that keeps none.

        Raises:
            ValueError: Wrong structure or shape (nothing is sent); a priority for a FIFO
                server, on a protocol-1 connection, or not a finite number >= 0;
                `end_episode`/`truncated` to a server that is not a sequence table.
            TypeError: A leaf is not an array (numpy, or anything with `__dlpack__`,
                `__array_interface__` or the buffer protocol, read without a copy when
                C-contiguous) or has another dtype (nothing is sent).
            ConnectionClosedError: After `close()`, or once the server is gone (and, with
                `reconnect=True`, reconnecting failed for `reconnect_timeout` seconds).
            ServerClosedError: With `reconnect=True`: the server closed for good
                (`Server.close()`; see `server_closing`), so there is nothing to reconnect to.
            TimeoutError: The window stayed full for `timeout` seconds, or (a learner with
                `admission="block"`) this worker stayed more than `max_staleness` versions
                behind it: fetch newer parameters with `params()` (nothing is sent).
        """
        # A flat-dict sample is looked up by key natively; anything else is flattened by the
        # layout.
        if end_episode is False and truncated is False and version is None:
            self._sender.send(sample, timeout, priority)
            return
        truncated = check_bool("truncated", truncated)
        end_episode = check_bool("end_episode", end_episode)
        wanted = None if version is None else check_int("version", version, 0, 2**64 - 1)
        self._sender.send(sample, timeout, priority, end_episode, truncated, wanted)

    def send_batch(
        self,
        batch: Any,
        *,
        timeout: float | None = None,
        priority: Any = None,
        end_episode: Any = None,
        truncated: Any = None,
        version: int | None = None,
    ) -> int:
        """Sends a batch of samples, one per row: what a vectorized environment's step gives.

        Every leaf has the example's dtype and shape with a leading dimension `N` in front,
        the same for all leaves. The rows are sent in order, exactly as `N` calls of `send()`
        would send them (the server stores `N` samples), but the batch is checked once and
        written with one vectored write per window-full of samples (`max_inflight_msgs`).

        Args:
            batch: A pytree with the example's structure whose leaves have `N` rows.
            timeout: Seconds to wait for room in the in-flight window; `None` waits as long
                as it takes.
            priority: One number for every row, or one per row (protocol 2, replay servers).
            end_episode: Sequence tables only: a bool for every row, or one per row (a vector
                env's `terminated`). Row `i` is a step of this client's stream `i`.
            truncated: Sequence tables only: as `end_episode`, for episodes cut short.
            version: As `send()`'s, for every row.

        Returns:
            `N`, the number of samples sent.

        Raises:
            ValueError, TypeError: As `send()`, for the batch as a whole (nothing is sent),
                or a leaf without the leading dimension, or leaves whose `N` differ.
            ConnectionClosedError, ServerClosedError: As `send()`.
            TimeoutError: No room within `timeout`; if some rows were sent, the message says
                how many (the first ones, in order).
        """
        if end_episode is None and truncated is None and version is None:
            return self._sender.send_batch(batch, timeout, priority)
        wanted = None if version is None else check_int("version", version, 0, 2**64 - 1)
        return self._sender.send_batch(batch, timeout, priority, end_episode, truncated, wanted)

    def send_group(
        self,
        samples: list[Any] | tuple[Any, ...],
        *,
        timeout: float | None = None,
        priority: float | None = None,
        version: int | None = None,
    ) -> None:
        """Sends `samples` as one group, stored atomically and handed out whole in one batch
        (the completions of one prompt, for GRPO). For examples with `echo.Ragged` leaves;
        see `Server.submit_group` (`version`: with policy versions, every sample's).

        Raises:
            ValueError: The example has no ragged leaf (or see the ragged client's errors).
        """
        raise ValueError("send_group is for examples with echo.Ragged leaves; use send()")

    def send_many(self, samples: Any, *, timeout: float | None = None) -> None:
        """Sends each sample of an iterable in order (one call per sample; a batch with one row
        per sample goes faster through `send_batch`)."""
        for sample in samples:
            self.send(sample, timeout=timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until every sent sample is acknowledged by the server.

        Raises:
            ConnectionClosedError: The server went away first.
            ServerClosedError: With `reconnect=True`: the server closed for good.
            TimeoutError: Not everything was acknowledged within `timeout` seconds.
        """
        self._sender.wait(timeout)

    def params(
        self, min_version: int | None = None, timeout: float | None = None
    ) -> tuple[int, Any]:
        """The learner's latest published parameters (`Server.publish`), as `(version,
        pytree)` in `params_example`'s structure (without one, the learner's, as nested dicts
        and lists, learned with the first call). Pulled from the learner in chunks (the GIL
        released, Ctrl-C honoured), each version whole: never a mix of two. The arrays are
        this call's own (one buffer), valid as long as the caller keeps them.

        Args:
            min_version: Wait for at least this version (`None`: any, but at least one
                published).
            timeout: Seconds to wait for such a version; `None` waits as long as it takes.

        Raises:
            ValueError: The learner publishes parameters of another size than
                `params_example`'s; without one, the learner's structure cannot be rebuilt
                (a namedtuple or custom node); the learner serves none (protocol 1).
            TimeoutError: No such version within `timeout` seconds.
            ConnectionClosedError: The connection is gone (with `reconnect=True`, once
                reconnecting gave up).
        """
        wanted = 0 if min_version is None else check_int("min_version", min_version, 0)
        layout = self._params_layout
        if layout is None:
            # Learned once from the learner: its pytree's structure, dtypes and shapes.
            layout = layout_of_description(self._sender.fetch_params_description(timeout))
            self._params_layout = layout
        size = sum(param_sizes(layout))
        version, data = self._sender.fetch_params(size, wanted, timeout)
        return version, param_tree(layout, data)

    @property
    def params_version(self) -> int:
        """The latest version of the learner's parameters it announced (0: none yet), known
        without a transfer: the learner tells every connection of each new version."""
        return self._sender.params_version

    @property
    def params_fetches(self) -> int:
        """Whole versions `params()` fetched."""
        return self._sender.params_fetches[0]

    @property
    def params_fetch_s(self) -> float:
        """Seconds `params()` calls took to fetch, in all (the mean fetch latency is this over
        `params_fetches`)."""
        return self._sender.params_fetches[1]

    @property
    def policy_version(self) -> int:
        """The version a sample carries when `send()` names none: the newest `params()`
        returned (0 before the first), or what was assigned here (a worker that gets its
        parameters another way)."""
        return self._sender.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self._sender.policy_version = check_int("policy_version", version, 0, 2**64 - 1)

    @property
    def keeps_versions(self) -> bool:
        """Whether the learner keeps the policy version of every sample (its
        `policy_versions=True` or `max_staleness`): this client's samples carry one."""
        return self._sender.policy_versions is not None

    @property
    def admission_waits(self) -> int:
        """`send()` calls that waited because this worker was more than `max_staleness`
        versions behind a learner with `admission="block"`."""
        return self._sender.admission_waits[0]

    @property
    def admission_wait_s(self) -> float:
        """Seconds `send()` calls waited for newer parameters, in all."""
        return self._sender.admission_waits[1]

    def wait_persisted(self, timeout: float | None = None) -> None:
        """With `durable=True`: blocks until every sent sample is in a checkpoint the learner
        completed (`persisted == sent`), reconnecting and resending meanwhile. Without, it
        returns at once once everything is acknowledged (nothing is kept for persistence).

        Raises:
            ConnectionClosedError, ServerClosedError: As `wait()`.
            TimeoutError: Not everything was persisted within `timeout` seconds (the learner
                checkpoints every `checkpoint_every` seconds).
        """
        if self._durable:
            self._sender.wait_persisted(timeout)
        else:
            self._sender.wait(timeout)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Flushes, then closes the connection. Idempotent; leaves no thread behind.

        Waits (at most `timeout` seconds) until everything sent is acknowledged (with
        `durable=True`: persisted, so the wait lasts until the learner's next checkpoint), so
        samples sent just before `close()` are delivered. Returns whether they all were. A worker
        shutting down that would rather not wait (the learner's rate limiter may hold its
        samples back for long) passes `timeout=0`: the unacknowledged samples are given up at
        once, and `given_up` says how many (and an INFO line on the `"echo"` logger).
        """
        if self._closed:
            return self._given_up == 0
        self._closed = True
        flushed = self._sender.close(timeout)
        self._given_up = max(0, self.sent - (self.persisted if self._durable else self.acked))
        if self._given_up:
            what = "not persisted" if self._durable else "unacknowledged"
            _log.info("%r: closed with %d samples %s (given up)", self, self._given_up, what)
        return flushed

    @property
    def given_up(self) -> int | None:
        """Samples sent but never acknowledged (with `durable=True`: never persisted) when
        `close()` gave up waiting (0 after a complete flush); `None` before `close()`. The
        server may still have stored some of them (their acknowledgements were on the way)
        or none."""
        return self._given_up

    @property
    def sent(self) -> int:
        """Samples sent so far."""
        return self._sender.sent

    @property
    def acked(self) -> int:
        """Samples the server has acknowledged so far."""
        return self._sender.acked

    @property
    def durable(self) -> bool:
        """Whether this client keeps its samples until they are persisted (`durable=True`)."""
        return self._durable

    @property
    def persisted(self) -> int:
        """With `durable=True`: how many of this client's samples are in a checkpoint the
        learner completed (every one before this number; samples count from 0), as its
        latest notice said. 0 before the first checkpoint, and without `durable`."""
        return self._sender.persisted

    @property
    def retained_bytes(self) -> int:
        """Bytes of samples this client keeps to resend: with `durable=True` those not yet
        persisted (at most `durable_bytes`, or one larger sample); with `reconnect=True`
        those not yet acknowledged."""
        return self._sender.retained_bytes

    @property
    def durable_waits(self) -> int:
        """`send()` calls that blocked because `durable_bytes` were full of samples not yet
        persisted (a learner that checkpoints too rarely for this worker's rate)."""
        return self._sender.durable_waits[0]

    @property
    def durable_wait_s(self) -> float:
        """Seconds `send()` calls blocked for `durable_bytes`, in all."""
        return self._sender.durable_waits[1]

    @property
    def protocol(self) -> int:
        """The wire protocol this connection speaks: 1 or 2."""
        return self._sender.protocol

    @property
    def sequence_rows(self) -> int | None:
        """How many streams this client may feed when the server is a sequence table (row
        `i` of `send_batch` is stream `i`); `None` for FIFO and replay servers."""
        return self._sender.takes_steps

    @property
    def transport_path(self) -> Literal["shm", "tcp"]:
        """Which path samples take: `"shm"` (same-host shared memory, see `shared_memory`)
        or `"tcp"`."""
        return self._sender.transport_path

    @property
    def wire_compression_leaves(self) -> dict[str, Codec]:
        """The leaves this connection sends compressed, by path (keys joined by `/`, as
        `Server.compress` names them), and their codec: what the server asked for, over TCP
        with `wire_compression=True`. Empty when every leaf goes raw (protocol 1, shared
        memory, a server without `compress=`, or `wire_compression=False`)."""
        codecs = self._sender.wire_codecs
        if codecs is None:
            return {}
        return {
            "/".join(str(key) for key in path): codec
            for path, codec in zip(self._layout.paths, codecs, strict=True)
            if codec is not None
        }

    @property
    def server_closing(self) -> Literal["final", "restarting"] | None:
        """What the server said the last time it closed this client's connection:
        `"final"` (`Server.close()`: a reconnecting client stops, and `send()`/`wait()` raise
        `ServerClosedError`), `"restarting"` (`close(restarting=True)`: it keeps trying), or
        `None` when it never did (it is up, or it vanished without a word, as a crash does,
        which a reconnecting client treats as "maybe restarting")."""
        return self._sender.server_closing

    @property
    def reconnects(self) -> int:
        """Times the client reconnected after its connection dropped."""
        return self._sender.reconnects

    @property
    def resent(self) -> int:
        """Samples sent again after reconnecting (unacknowledged when the connection
        dropped; the server stores each once)."""
        return self._sender.resent

    @property
    def resumed_from(self) -> int | None:
        """Where the latest reconnection resumed: how many of this client's samples the
        server said it already had, which is also the number of the first sample sent again
        (samples count from 0). The samples from there to what `sent` was at that moment were
        resent. `None` before any reconnection (and with `reconnect=False`, always)."""
        return self._sender.resumed_from

    def __enter__(self) -> TcpClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        named = "" if self._name is None else f"name={self._name!r}, "
        return (
            f"TcpClient({named}protocol={self.protocol}, path={self.transport_path!r}, "
            f"sent={self.sent}, acked={self.acked}, "
            f"closed={self._closed})"
        )


# `inspect.signature(TcpClient)` (help(), IDEs, code that asks which arguments it takes) shows
# the constructor's arguments, not those of `__new__`, which only picks the class.
setattr(TcpClient, "__signature__", ConstructorSignature())  # noqa: B010
