"""A worker's view of its learner's life: a first connection before the learner listens, a
learner that closes for good or to restart (and one that crashes), a worker that gives up its
unacknowledged samples at close, and the worker's name in its log lines."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import WAIT_S, child_env, read_line
from testkit.net import LOCALHOST

import echo
from echo import ServerClosedError, TcpClient, TcpTransport
from echo._echo import ConnectionClosedError

PATHS = [pytest.param(False, id="tcp"), pytest.param(True, id="shm")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return int(s.getsockname()[1])


def replay_server(make_server: Callable[..., echo.Server], port: int = 0, **kw: Any) -> Any:
    kw.setdefault("sampler", echo.Uniform())
    kw.setdefault("max_size", 10_000)
    return make_server(transport=TcpTransport(port=port, host=LOCALHOST), **kw)


def stored_ids(server: echo.Server, tmp_path: Any, name: str = "now") -> list[int]:
    """Every id in a replay server (its table and ingress queue), duplicates kept."""
    path = tmp_path / name
    server.checkpoint(path)
    ids = [np.load(path / "leaf_000.npy")]
    if (path / "ingress_leaf_000.npy").exists():
        ids.append(np.load(path / "ingress_leaf_000.npy"))
    return sorted(int(i) for i in np.concatenate(ids))


def send_until_it_fails(client: TcpClient, make_sample: Callable[[int], Any], first: int) -> None:
    """Sends (and waits for the acks of) samples from id `first` on until a call raises."""
    for i in range(first, first + 10_000):
        client.send(make_sample(i), timeout=WAIT_S)
        client.wait(timeout=WAIT_S)
    pytest.fail("10,000 samples went through: the server never went away")


def test_reconnect_true_retries_the_first_connection_until_the_learner_listens(
    make_server: Callable[..., echo.Server],
    example: dict[str, np.ndarray],
    make_sample: Callable[[int], Any],
    tmp_path: Any,
) -> None:
    port = free_port()
    server = replay_server(make_server, port)
    starter = threading.Timer(0.5, server.start)
    starter.start()
    try:
        client = TcpClient(LOCALHOST, port, example, reconnect=True, reconnect_timeout=WAIT_S)
    finally:
        starter.join()
    for i in range(5):
        client.send(make_sample(i))
    client.wait(timeout=WAIT_S)
    assert client.close() is True
    assert stored_ids(server, tmp_path) == [0, 1, 2, 3, 4]


def test_without_reconnect_a_refused_first_connection_raises_at_once(
    example: dict[str, np.ndarray],
) -> None:
    with pytest.raises(ConnectionRefusedError, match=f"{LOCALHOST}:"):
        TcpClient(LOCALHOST, free_port(), example)


def test_reconnect_true_gives_up_on_the_first_connection_with_timeout_error(
    example: dict[str, np.ndarray],
) -> None:
    port = free_port()
    started = time.monotonic()
    with pytest.raises(
        TimeoutError, match=rf"could not connect to {LOCALHOST}:{port} within .*refused"
    ):
        TcpClient(
            LOCALHOST, port, example, reconnect=True, reconnect_timeout=0.5, connect_timeout=0.2
        )
    assert time.monotonic() - started >= 0.5  # it kept trying for the whole reconnect_timeout


def test_reconnect_true_does_not_retry_what_another_attempt_would_repeat(
    make_server: Callable[..., echo.Server],
) -> None:
    server = replay_server(make_server)
    server.start()
    other = {"id": np.zeros((), np.int32), "obs": np.zeros((3,), np.float32)}
    started = time.monotonic()
    with pytest.raises(ValueError, match="another layout"):
        TcpClient(LOCALHOST, server.port, other, reconnect=True, reconnect_timeout=WAIT_S)
    assert time.monotonic() - started < WAIT_S


@pytest.mark.parametrize("shared_memory", PATHS)
def test_a_final_close_stops_a_reconnecting_worker_at_once(
    make_server: Callable[..., echo.Server],
    example: dict[str, np.ndarray],
    make_sample: Callable[[int], Any],
    shared_memory: bool,
) -> None:
    server = replay_server(make_server)
    server.start()
    client = TcpClient(
        LOCALHOST,
        server.port,
        example,
        reconnect=True,
        reconnect_timeout=60.0,
        shared_memory=shared_memory,
    )
    assert client.transport_path == ("shm" if shared_memory else "tcp")
    for i in range(10):
        client.send(make_sample(i))
    client.wait(timeout=WAIT_S)
    assert client.server_closing is None
    server.close()
    started = time.monotonic()
    with pytest.raises(ServerClosedError, match=r"closed for good \(Server.close\(\)\)"):
        send_until_it_fails(client, make_sample, 10)  # the first send after the notice raises
    assert time.monotonic() - started < 30.0  # far from the 60 s of reconnect_timeout
    assert client.server_closing == "final"
    assert client.reconnects == 0
    with pytest.raises(ServerClosedError):
        client.send(make_sample(0))
    client.close(timeout=0)


def test_server_closed_error_is_a_connection_closed_error_and_a_runtime_error() -> None:
    assert issubclass(ServerClosedError, ConnectionClosedError)
    assert issubclass(ServerClosedError, ConnectionError)
    assert issubclass(ServerClosedError, RuntimeError)  # as before, for in-process callers
    assert echo.ConnectionClosedError is ConnectionClosedError


def _worker_loop(client: TcpClient, make_sample: Callable[[int], Any], catch: type) -> str:
    """A worker loop as the TCP guide writes it: send until the connection ends, then stop.
    Bounded: a loop the exception does not end fails the test instead of hanging it."""
    deadline = time.monotonic() + WAIT_S
    i = 0
    try:
        while time.monotonic() < deadline:
            client.send(make_sample(i), timeout=WAIT_S)
            i += 1
            time.sleep(0.001)
    except catch as e:
        return type(e).__name__
    return "still sending"


@pytest.mark.parametrize("catch", [ConnectionClosedError, ServerClosedError, ConnectionError])
def test_a_reconnecting_worker_loop_ends_on_a_final_close_with_either_except(
    make_server: Callable[..., echo.Server],
    example: dict[str, np.ndarray],
    make_sample: Callable[[int], Any],
    catch: type[Exception],
) -> None:
    # `except ConnectionClosedError` is what the guides tell a worker loop to catch; a final
    # close() raises ServerClosedError at a reconnecting worker, which must end that loop
    # as it ends one that catches ServerClosedError itself.
    server = replay_server(make_server)
    server.start()
    client = TcpClient(LOCALHOST, server.port, example, reconnect=True, reconnect_timeout=60.0)
    try:
        client.send(make_sample(0))
        client.wait(timeout=WAIT_S)
        server.close()
        assert _worker_loop(client, make_sample, catch) == "ServerClosedError"
    finally:
        client.close(timeout=0)


def test_a_final_close_is_a_connection_closed_error_for_a_worker_that_does_not_reconnect(
    make_server: Callable[..., echo.Server],
    example: dict[str, np.ndarray],
    make_sample: Callable[[int], Any],
) -> None:
    server = replay_server(make_server)
    server.start()
    client = TcpClient(LOCALHOST, server.port, example, shared_memory=False)
    client.send(make_sample(0))
    client.wait(timeout=WAIT_S)
    server.close()
    with pytest.raises(ConnectionClosedError, match="closed for good"):
        send_until_it_fails(client, make_sample, 1)
    assert client.server_closing == "final"
    client.close(timeout=0)


@pytest.mark.parametrize("shared_memory", PATHS)
def test_a_restarting_close_keeps_workers_trying_until_the_restored_learner_is_back(
    make_server: Callable[..., echo.Server],
    example: dict[str, np.ndarray],
    make_sample: Callable[[int], Any],
    tmp_path: Any,
    shared_memory: bool,
) -> None:
    first = replay_server(make_server)
    first.start()
    port = first.port
    assert port is not None
    client = TcpClient(
        LOCALHOST,
        port,
        example,
        reconnect=True,
        reconnect_timeout=60.0,
        shared_memory=shared_memory,
    )
    for i in range(20):
        client.send(make_sample(i))
    client.wait(timeout=WAIT_S)
    first.checkpoint(tmp_path / "ckpt")
    first.close(restarting=True)
    # The learner comes back a moment later, restored, on the same port.
    restored: list[echo.Server] = []

    def come_back() -> None:
        server = echo.Server.restore(
            tmp_path / "ckpt", example, transport=TcpTransport(port=port, host=LOCALHOST)
        )
        restored.append(server)
        server.start()

    back = threading.Timer(0.5, come_back)
    back.start()
    try:
        for i in range(20, 40):  # sent while the learner is away, resent when it is back
            client.send(make_sample(i), timeout=WAIT_S)
        client.wait(timeout=WAIT_S)
    finally:
        back.join()
    assert client.server_closing == "restarting"
    assert client.reconnects >= 1
    assert client.close() is True
    (server,) = restored
    try:
        assert stored_ids(server, tmp_path) == list(range(40))
    finally:
        server.close()


def test_a_crashed_learner_says_nothing_and_workers_keep_trying(
    example: dict[str, np.ndarray], make_sample: Callable[[int], Any]
) -> None:
    code = textwrap.dedent(
        f"""
        import time, numpy as np, echo
        ex = {{"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}}
        server = echo.Server(ex, 4, echo.TcpTransport(port=0, host="{LOCALHOST}"),
                             sampler=echo.Uniform(), max_size=100)
        server.start()
        print(server.port, flush=True)
        time.sleep({WAIT_S * 6})
        """
    )
    learner = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=child_env()
    )
    try:
        port = int(read_line(learner, WAIT_S))
        client = TcpClient(
            LOCALHOST, port, example, reconnect=True, reconnect_timeout=1.0, shared_memory=False
        )
        client.send(make_sample(0))
        client.wait(timeout=WAIT_S)
        os.kill(learner.pid, signal.SIGKILL)
        learner.wait(timeout=WAIT_S)
        with pytest.raises(ConnectionClosedError, match="could not reconnect"):
            send_until_it_fails(client, make_sample, 1)
        assert client.server_closing is None  # "maybe restarting": it tried to reconnect
        client.close(timeout=0)
    finally:
        if learner.poll() is None:
            learner.kill()
        learner.wait(timeout=WAIT_S)
        assert learner.stdout is not None
        learner.stdout.close()


def test_close_with_timeout_0_gives_up_what_a_rate_limiter_holds_back_and_says_how_many(
    make_server: Callable[..., echo.Server],
    example: dict[str, np.ndarray],
    make_sample: Callable[[int], Any],
) -> None:
    # Inserts stop after 4 until something samples; nothing does.
    limiter = echo.SampleToInsertRatio(
        samples_per_insert=1.0, min_size_to_sample=2, error_buffer=2.0
    )
    server = replay_server(make_server, rate_limiter=limiter, producer_queue_size=1)
    server.start()
    client = TcpClient(LOCALHOST, server.port, example, max_inflight_msgs=8, shared_memory=False)
    for i in range(8):
        client.send(make_sample(i), timeout=WAIT_S)
    with pytest.raises(TimeoutError):
        client.wait(timeout=0.3)  # held back
    assert client.given_up is None
    started = time.monotonic()
    assert client.close(timeout=0) is False
    assert time.monotonic() - started < WAIT_S
    assert client.given_up == client.sent - client.acked
    assert client.given_up > 0
    assert client.close(timeout=0) is False  # idempotent, same answer


def test_a_complete_flush_gives_up_nothing(
    make_server: Callable[..., echo.Server],
    example: dict[str, np.ndarray],
    make_sample: Callable[[int], Any],
) -> None:
    server = replay_server(make_server)
    server.start()
    client = TcpClient(LOCALHOST, server.port, example)
    client.send(make_sample(0))
    assert client.close() is True
    assert client.given_up == 0


def test_a_named_worker_says_its_name_when_it_reconnects(
    make_server: Callable[..., echo.Server],
    example: dict[str, np.ndarray],
    make_sample: Callable[[int], Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = replay_server(make_server)
    server.start()
    caplog.set_level(logging.INFO, logger="echo")
    client = TcpClient(
        LOCALHOST,
        server.port,
        example,
        reconnect=True,
        reconnect_timeout=0.5,
        name="worker-7",
        shared_memory=False,
    )
    client.send(make_sample(0))
    client.wait(timeout=WAIT_S)
    server.close(restarting=True)
    with pytest.raises(ConnectionClosedError):
        send_until_it_fails(client, make_sample, 1)
    client.close(timeout=0)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("echo")]
    assert any(
        line.startswith(f"worker-7 ({LOCALHOST}:{server.port}): connection lost") for line in lines
    ), lines


@pytest.mark.parametrize("shared_memory", PATHS)
def test_a_final_close_reaches_a_worker_the_rate_limiter_holds_back(
    make_server: Callable[..., echo.Server],
    example: dict[str, np.ndarray],
    make_sample: Callable[[int], Any],
    shared_memory: bool,
) -> None:
    # Inserts stop after a few until something samples; nothing does, so the server's side of
    # the connection waits for the limiter when close() comes.
    limiter = echo.SampleToInsertRatio(
        samples_per_insert=1.0, min_size_to_sample=2, error_buffer=2.0
    )
    server = replay_server(make_server, rate_limiter=limiter, producer_queue_size=1)
    server.start()
    client = TcpClient(
        LOCALHOST,
        server.port,
        example,
        max_inflight_msgs=8,
        reconnect=True,
        reconnect_timeout=60.0,
        shared_memory=shared_memory,
    )
    for i in range(8):
        client.send(make_sample(i), timeout=WAIT_S)
    with pytest.raises(TimeoutError):
        client.wait(timeout=0.3)  # held back by the limiter
    server.close()
    started = time.monotonic()
    with pytest.raises(ServerClosedError, match="closed for good"):
        client.wait(timeout=WAIT_S)
    assert time.monotonic() - started < WAIT_S  # not the 60 s of reconnect_timeout
    assert client.server_closing == "final"
    client.close(timeout=0)
