"""`echo.TcpClient` when the example has ragged leaves: a worker of a ragged server.

`TcpClient(host, port, example)` builds a `RaggedTcpClient` when a leaf of `example` is
`echo.Ragged` (`TcpClient.__new__`). It speaks wire v2 only (a ragged leaf cannot be described
in v1), sends each sample or group as one frame, and checks lengths, length groups and the
server's group size before anything is sent. On the server's host the frames go through a
shared-memory pipe instead of the socket (`shared_memory=`, as for any `TcpClient`). With
`reconnect=True` it keeps each frame until its samples are stored, and after a lost
connection connects again (for up to `reconnect_timeout`) and resends exactly what the
server did not store; with `heartbeat_timeout` (the learner beats every third of it) a
connection that goes silent is taken as lost too. To a server that keeps policy versions
every sample carries one (`policy_version`, or `send(version=)`). With `durable=True` it
keeps every frame until a checkpoint the learner completed holds it, and resends to a
restored learner what its checkpoint lacks. `params()` fetches the learner's parameters
over the same connection.
Over TCP it compresses the leaves the server's `compress=` names (`wire_compression=True`,
the default), which the server checks and stores as they came; through the pipe they go raw.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any, Literal, NoReturn

from echo._echo import ConnectionClosedError, RaggedSender
from echo._params import layout_of_description, param_sizes, param_tree
from echo._pytree import TreeLayout
from echo._validate import check_bool, check_int, check_seconds, check_token
from echo.client import TcpClient
from echo.compression import Codec
from echo.ragged import RaggedLayout

__all__ = ["RaggedTcpClient"]


def _unsupported(what: str) -> NoReturn:
    raise ValueError(f"a TcpClient with ragged leaves does not support {what} yet")


class RaggedTcpClient(TcpClient):
    """A `TcpClient` whose example has `echo.Ragged` leaves (see `TcpClient`)."""

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

    def _open(  # pyright: ignore[reportIncompatibleMethodOverride]
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
        """Checks the settings and connects (the constructor's body); `resolver` and
        `dial_timeout` as for `TcpClient` (`echo.ray`)."""
        self._closed = True  # until connected: `close()` and `__del__` have nothing to do
        self._given_up: int | None = None
        self._name = name
        self._durable = check_bool("durable", durable)
        durable_bytes = check_int("durable_bytes", durable_bytes, 1, 2**63 - 1)
        if self._durable:
            reconnect = True
        if protocol == 1:
            raise ValueError(
                "protocol=1 cannot carry ragged leaves (id-echo 0.2.1's wire has fixed shapes)"
            )
        self._params_layout = None if params_example is None else TreeLayout(params_example)
        token = check_token("token", token) or os.environ.get("ECHO_TOKEN") or None
        self._layout = RaggedLayout(data_sample)
        reconnect = check_bool("reconnect", reconnect)
        retry_for = check_seconds("reconnect_timeout", reconnect_timeout, optional=False)
        connect = check_seconds("connect_timeout", connect_timeout, optional=False)
        assert retry_for is not None
        assert connect is not None
        if dial_timeout is None and reconnect:
            # The first connection is retried too (a worker started before its learner).
            dial_timeout = max(connect, retry_for)
        self._ragged_sender = RaggedSender(
            host,
            check_int("port", port, 0, 65535),
            self._layout.core_leaves(),
            None if token is None else token.encode(),
            connect,
            check_int("max_inflight_msgs", max_inflight_msgs, 1, 2**32 - 1),
            None if shared_memory is None else check_bool("shared_memory", shared_memory),
            retry_for if reconnect else None,
            resolver,
            None if dial_timeout is None else float(dial_timeout),
            durable_bytes if self._durable else None,
            check_bool("wire_compression", wire_compression),
            check_seconds("heartbeat_timeout", heartbeat_timeout, optional=True),
        )
        self._ragged_sender.set_reader(self._layout.flat_keys, self._layout.flatten)
        self._closed = False

    def send(  # pyright: ignore[reportIncompatibleMethodOverride]
        self,
        sample: Any,
        *,
        timeout: float | None = None,
        priority: float | None = None,
        end_episode: bool = False,
        truncated: bool = False,
        version: int | None = None,
    ) -> None:
        """Sends one sample (see `TcpClient.send`); its ragged leaves `(n, *inner_shape)`.
        `version`: to a server that keeps policy versions, the version of the policy that made
        it (default `policy_version`)."""
        if end_episode or truncated:
            _unsupported("end_episode= or truncated=")
        if self._closed:
            raise ConnectionClosedError("the client is closed")
        v = None if version is None else check_int("version", version, 0, 2**64 - 1)
        p = None if priority is None else float(priority)
        self._ragged_sender.send(sample, p, timeout, v)

    def send_group(
        self,
        samples: list[Any] | tuple[Any, ...],
        *,
        timeout: float | None = None,
        priority: float | None = None,
        version: int | None = None,
    ) -> None:
        """Sends `samples` as one group: the server stores them atomically and hands them out
        whole, in one batch (the completions of one prompt, for GRPO). `version`: as
        `send()`'s, for every sample of the group.

        Raises:
            ValueError: A sample does not match the example, a ragged leaf is longer than its
                `max_len`, lengths differ within a length group, or the group is larger than
                the server's batch (nothing is sent); or the server refused an earlier frame
                (e.g. more rows than its `batch_tokens`), whose message this carries.
            TypeError: `samples` is not a list, or a leaf has another dtype.
            ConnectionClosedError: After `close()`, or the server is gone.
            ServerClosedError: The server closed.
            TimeoutError: `max_inflight_msgs` samples stayed unacknowledged for `timeout`.
        """
        if self._closed:
            raise ConnectionClosedError("the client is closed")
        if isinstance(samples, dict) or not isinstance(samples, list | tuple):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(f"send_group takes a list of samples, got {type(samples).__name__}")
        flat = [self._layout.flatten(sample) for sample in samples]
        p = None if priority is None else float(priority)
        v = None if version is None else check_int("version", version, 0, 2**64 - 1)
        self._ragged_sender.send_group(flat, p, timeout, v)

    def send_batch(self, *args: Any, **kwargs: Any) -> None:  # pyright: ignore[reportIncompatibleMethodOverride]
        _unsupported("send_batch() (use send() or send_group())")

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until every sample sent is stored by the server."""
        self._ragged_sender.flush(timeout)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Waits (at most `timeout` seconds) until everything sent is stored (durable:
        persisted, so until the learner's next checkpoint), then closes. Returns whether it
        all was; `given_up` says how many samples were not."""
        if self._closed:
            return self._given_up == 0
        self._closed = True
        with contextlib.suppress(Exception):  # the count below says what was lost
            if self._durable:
                self._ragged_sender.wait_persisted(timeout)
            else:
                self._ragged_sender.flush(timeout)
        self._ragged_sender.close()
        sent, acked = self._ragged_sender.counts
        self._given_up = sent - (self._ragged_sender.persisted if self._durable else acked)
        return self._given_up == 0

    @property
    def sent(self) -> int:
        return self._ragged_sender.counts[0]

    @property
    def acked(self) -> int:
        return self._ragged_sender.counts[1]

    @property
    def protocol(self) -> int:
        return 2

    @property
    def transport_path(self) -> Literal["shm", "tcp"]:
        return "shm" if self._ragged_sender.path == "shm" else "tcp"

    @property
    def durable(self) -> bool:
        return self._durable

    @property
    def reconnects(self) -> int:
        return self._ragged_sender.recoveries[0]

    @property
    def resent(self) -> int:
        return self._ragged_sender.recoveries[1]

    @property
    def resumed_from(self) -> int | None:
        return self._ragged_sender.resumed_from

    @property
    def server_closing(self) -> Literal["final", "restarting"] | None:
        return self._ragged_sender.server_closing

    @property
    def retained_bytes(self) -> int:
        """Bytes of frames kept to resend: with `durable=True` those not yet persisted, with
        `reconnect=True` those not known to be stored; 0 without."""
        return self._ragged_sender.retained_bytes

    def wait_persisted(self, timeout: float | None = None) -> None:
        """With `durable=True`: blocks until every sent sample is in a checkpoint the
        learner completed (`persisted == sent`), reconnecting and resending meanwhile.
        Without, as `wait()`."""
        if self._durable:
            self._ragged_sender.wait_persisted(timeout)
        else:
            self.wait(timeout)

    @property
    def persisted(self) -> int:
        """With `durable=True`: how many of this client's samples are in a checkpoint the
        learner completed, as its latest notice said; 0 without."""
        return self._ragged_sender.persisted

    @property
    def durable_waits(self) -> int:
        return self._ragged_sender.durable_waits[0]

    @property
    def durable_wait_s(self) -> float:
        return self._ragged_sender.durable_waits[1]

    def params(
        self, min_version: int | None = None, timeout: float | None = None
    ) -> tuple[int, Any]:
        """The learner's latest published parameters (see `TcpClient.params`): `(version,
        pytree)`, pulled over this worker's connection in chunks (a version whole, never a mix
        of two), in `params_example`'s structure or the learner's. The version becomes
        `policy_version`."""
        wanted = 0 if min_version is None else check_int("min_version", min_version, 0)
        layout = self._params_layout
        if layout is None:
            # Learned once from the learner: its pytree's structure, dtypes and shapes.
            layout = layout_of_description(self._ragged_sender.fetch_params_description(timeout))
            self._params_layout = layout
        size = sum(param_sizes(layout))
        version, data = self._ragged_sender.fetch_params(size, wanted, timeout)
        return version, param_tree(layout, data)

    @property
    def params_version(self) -> int:
        """The latest version of the learner's parameters it announced (0: none yet), known
        without a transfer: the learner tells every connection of each `publish()`."""
        return self._ragged_sender.params_version

    @property
    def params_fetches(self) -> int:
        return self._ragged_sender.params_fetches[0]

    @property
    def params_fetch_s(self) -> float:
        return self._ragged_sender.params_fetches[1]

    @property
    def policy_version(self) -> int:
        """The version a sample carries when `send()` names none (0 until set): the version
        of the weights this worker acts with, which it learns another way than `params()`."""
        return self._ragged_sender.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:  # pyright: ignore[reportIncompatibleVariableOverride]
        self._ragged_sender.policy_version = check_int("policy_version", version, 0, 2**64 - 1)

    @property
    def keeps_versions(self) -> bool:
        """Whether the server keeps the policy version of every sample (its
        `policy_versions=True` or `max_staleness`): this client's samples carry one."""
        return self._ragged_sender.keeps_versions

    @property
    def admission_waits(self) -> int:
        """`send()` calls that waited because this worker was more than `max_staleness`
        versions behind a learner with `admission="block"`."""
        return self._ragged_sender.admission_waits[0]

    @property
    def admission_wait_s(self) -> float:
        """Seconds `send()` calls waited for newer weights, in all."""
        return self._ragged_sender.admission_waits[1]

    @property
    def sequence_rows(self) -> None:
        return None

    @property
    def wire_compression_leaves(self) -> dict[str, Codec]:
        """The leaves this connection sends compressed, by path (keys joined by `/`, as
        `Server.compress` names them), and their codec: what the server asked for (its
        `compress=`), over TCP with `wire_compression=True`. Empty when every leaf goes raw
        (shared memory, a server without `compress=`, or `wire_compression=False`)."""
        codecs = self._ragged_sender.wire_codecs
        if codecs is None:
            return {}
        return {
            leaf.key: codec
            for leaf, codec in zip(self._layout.leaves, codecs, strict=True)
            if codec is not None
        }

    def __repr__(self) -> str:
        named = "" if self._name is None else f"name={self._name!r}, "
        return (
            f"TcpClient({named}ragged, sent={self.sent}, acked={self.acked}, closed={self._closed})"
        )
