"""Ragged workers and half-open connections: with `heartbeat_timeout=t` the learner sends a
heartbeat every third of `t`, so a worker whose connection goes silent (a partition, a
learner host gone without a word; here a proxy that stops forwarding but keeps both sockets
open) takes it as lost within about `t`, connects again (`reconnect=True`) and resends what
was not stored: every sample once. An idle worker on a live connection is not disturbed."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import test_wire_v2 as _wire_v2
from test_wire_v2 import Proxy

import echo
from echo import Ragged

#: The child-process fixtures of the wire v2 tests.
children = _wire_v2.children
proxy = _wire_v2.proxy

HEARTBEAT_S = 1.0
#: How late a detection may be past the heartbeat timeout on a loaded 2-core machine.
SLACK_S = 4.0


def example() -> dict[str, Any]:
    return {"tokens": Ragged(100, np.int32), "id": np.zeros((), np.int64)}


def make(i: int) -> dict[str, Any]:
    return {"tokens": np.arange(i % 101, dtype=np.int32) + i, "id": np.int64(i)}


def learner() -> echo.Server:
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    server = echo.Server(example(), 4, transport=transport, sampler=echo.Uniform(), max_size=1000)
    server.start()
    return server


def ids_of(server: echo.Server) -> list[int]:
    """Every id the replay server holds, each drawn until all were seen, checked intact."""
    n = server.stats().store_size
    seen: dict[int, int] = {}
    for _ in range(10_000):
        if len(seen) == n:
            break
        s = server.sample(timeout=5)
        assert s is not None
        cu = s.batch["tokens"].cu_seqlens
        for k, i in enumerate(s.batch["id"].tolist()):
            np.testing.assert_array_equal(
                s.batch["tokens"].values[cu[k] : cu[k + 1]], make(i)["tokens"]
            )
            seen[i] = 1
    return sorted(seen)


def test_a_worker_takes_a_silent_connection_as_lost_and_resends_once(
    proxy: Callable[..., Proxy],
) -> None:
    server = learner()
    assert server.port is not None
    relay = proxy(server.port)
    client = echo.TcpClient(
        "127.0.0.1", relay.port, example(), shared_memory=False, reconnect=True,
        reconnect_timeout=30, heartbeat_timeout=HEARTBEAT_S,
    )  # fmt: skip
    try:
        for i in range(20):
            client.send(make(i), timeout=10)
        client.wait(timeout=10)
        assert relay.command("stall").startswith("ok stall 1")
        stalled = time.monotonic()
        for i in range(20, 40):  # into the stalled connection: never acknowledged there
            client.send(make(i), timeout=10)
        client.wait(timeout=HEARTBEAT_S + SLACK_S + 10)
        took = time.monotonic() - stalled
        assert client.reconnects >= 1, "the silent connection was given up"
        assert took < HEARTBEAT_S + SLACK_S, f"{took:.1f} s to notice and resend"
        assert client.acked == 40
        assert ids_of(server) == list(range(40)), "every sample once, intact"
    finally:
        client.close(timeout=10)
        server.close()


def test_an_idle_worker_on_a_live_connection_stays_connected() -> None:
    """The learner's heartbeats keep an idle worker's connection, over TCP and through its
    shared-memory pipe (whose socket carries nothing else)."""
    server = learner()
    assert server.port is not None
    clients = [
        echo.TcpClient(
            "127.0.0.1",
            server.port,
            example(),
            shared_memory=shm,
            reconnect=True,
            heartbeat_timeout=HEARTBEAT_S,
        )
        for shm in (False, None)
    ]
    try:
        for c in clients:
            c.send(make(1), timeout=10)
            c.wait(timeout=10)
        time.sleep(4 * HEARTBEAT_S)  # idle: only heartbeats on the sockets
        for k, c in enumerate(clients):
            c.send(make(2 + k), timeout=10)
            c.wait(timeout=10)
            assert c.reconnects == 0, c.transport_path
        assert ids_of(server) == [1, 2, 3]
    finally:
        for c in clients:
            c.close(timeout=10)
        server.close()


def test_heartbeat_timeout_is_checked() -> None:
    server = learner()
    assert server.port is not None
    try:
        with pytest.raises(ValueError, match="heartbeat_timeout must be a positive number"):
            echo.TcpClient("127.0.0.1", server.port, example(), heartbeat_timeout=0)
    finally:
        server.close()
