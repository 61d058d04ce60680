"""The TCP path end to end: `TcpTransport`, `TcpClient` and `Server.start()`/`port`.

Everything runs over loopback (127.0.0.1) on ephemeral ports; every wait and loop is bounded
in count and time. Samples are conftest's `example` (`make_sample(i)` encodes id `i` in every
value), so `batch_ids` both reads a batch's ids and checks that no slot is torn.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import os
import queue
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _blocked import after
from conftest import assert_blocked, assert_ctrl_c_interrupts_promptly, poll
from testkit.net import recv_exact, take

import echo
from echo import ConnectionClosedError, Server, TcpClient, TcpTransport

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_worker.py"
if str(HERE) not in sys.path:  # pytest's default import mode puts it there already
    sys.path.insert(0, str(HERE))
from _worker import ID_STRIDE  # noqa: E402

# Bound on any single blocking step before it counts as a hang.
WAIT_S = 10.0
# How long a thread must stay blocked before we believe it is waiting, not just slow.
BLOCKED_S = 0.3
LOCALHOST = "127.0.0.1"

# conftest's example on the wire: int64 id (8 bytes) then float32[3] obs (12 bytes).
PAYLOAD = 20
HANDSHAKE = (
    b"ECHO\x01"
    + (2).to_bytes(4, "little")
    + b"".join(w.to_bytes(4, "little") for w in (8, 0))  # id: 8-byte elements, 0 dims
    + b"".join(w.to_bytes(4, "little") for w in (4, 1, 3))  # obs: 4-byte elements, (3,)
)
# After the v1 handshake an open echo server offers wire v2: b"ECHO" 0x02 b"o" and 32 hex
# digits, no 0x01 byte among them (a v1 client counts those as acks).
OFFER_LEN = 38


def _read_greeting(sock: socket.socket) -> None:
    """Reads an open echo server's greeting as a v1 client does: the handshake (checked byte
    by byte), then the v2 offer, which v1 clients skip."""
    assert recv_exact(sock, len(HANDSHAKE)) == HANDSHAKE
    offer = recv_exact(sock, OFFER_LEN)
    assert offer[:6] == b"ECHO\x02o", offer
    assert b"\x01" not in offer, offer


def _tcp(**kwargs: Any) -> TcpTransport:
    return TcpTransport(port=0, host=LOCALHOST, **kwargs)


def _raw_sample(i: int) -> bytes:
    """Sample `i` exactly as a v1 client puts it on the wire."""
    return np.array(i, np.int64).tobytes() + np.full((3,), i, np.float32).tobytes()


def _started(make_server: Callable[..., Server], **kwargs: Any) -> Server:
    kwargs.setdefault("transport", _tcp())
    server = make_server(**kwargs)
    server.start()
    assert isinstance(server.port, int)
    assert server.port > 0
    return server


def _started_with_client(
    make_server: Any, example: Any, window: int | None = None, **kwargs: Any
) -> tuple[Server, TcpClient]:
    """`_started(make_server, **kwargs)` and a client connected to it over TCP (`window`: its
    `max_inflight_msgs`, default if None). TCP, not the same-host shared memory a default
    client would take: these tests are about the TCP ingress's queues and window."""
    server = _started(make_server, **kwargs)
    limits = {} if window is None else {"max_inflight_msgs": window}
    return server, TcpClient(LOCALHOST, server.port, example, shared_memory=False, **limits)


def _poll_stats(server: Server, done: Callable[[Any], bool], what: str) -> Any:
    return poll(server.stats, done, what)


def _connections(server: Server, n: int) -> Any:
    return _poll_stats(
        server, lambda info: info.active_connections == n, f"active_connections == {n}"
    )


def _raw_connect(port: int) -> socket.socket:
    return socket.create_connection((LOCALHOST, port), timeout=WAIT_S)


# --- the README example with worker processes ----------------------------------------------

SAMPLES_PER_WORKER = 200


def _kill_all(procs: list[subprocess.Popen[str]]) -> str:
    """Kills what still runs, reaps everything; returns the workers' stderr for a message."""
    report = []
    for k, proc in enumerate(procs):
        if proc.poll() is None:
            proc.kill()
        out, err = proc.communicate(timeout=WAIT_S)
        if proc.returncode != 0 or err:
            report.append(f"worker {k}: rc={proc.returncode} stdout={out!r} stderr={err!s:.2000}")
    return "\n".join(report)


@pytest.mark.parametrize("mode", ["stay", "close", "wait_close"])
@pytest.mark.parametrize("num_workers", [1, 8, 32])
def test_readme_example_with_worker_processes(
    make_server: Any, batch_ids: Any, num_workers: int, mode: str
) -> None:
    """Every sample of every worker process arrives exactly once and in per-worker order,
    whether the workers stay connected, `close()` right after sending, or `wait()` first."""
    batch_size = 40
    server = _started(make_server, batch_size=batch_size)
    total = num_workers * SAMPLES_PER_WORKER
    assert total % batch_size == 0
    stdin = subprocess.PIPE if mode == "stay" else subprocess.DEVNULL
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    args = [str(server.port), "{w}", str(SAMPLES_PER_WORKER), mode]
    procs: list[subprocess.Popen[str]] = []
    try:
        # Start them all first: interpreter start-up dominates, so let it overlap.
        for w in range(num_workers):
            cmd = [sys.executable, str(WORKER), *(a.format(w=w) for a in args)]
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdin=stdin,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )
        per_worker: dict[int, list[int]] = collections.defaultdict(list)
        for _ in range(total // batch_size):
            try:
                sample = server.sample(timeout=2 * WAIT_S)
            except TimeoutError:
                pytest.fail(f"no batch within {2 * WAIT_S}s; workers:\n{_kill_all(procs)}")
            assert sample is not None
            for i in batch_ids(sample.batch):
                per_worker[i // ID_STRIDE].append(i % ID_STRIDE)
        assert sorted(per_worker) == list(range(num_workers))
        for w, seqs in per_worker.items():
            assert seqs == list(range(SAMPLES_PER_WORKER)), f"worker {w}: {seqs}"
        if mode == "stay":
            # Every worker is still connected (blocked on its stdin, which communicate() closes).
            assert server.stats().active_connections == num_workers
        outputs = [proc.communicate(timeout=2 * WAIT_S) for proc in procs]
        for w, (proc, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
            assert proc.returncode == 0, f"worker {w}: rc={proc.returncode}, stderr:\n{err}"
            assert err == "", f"worker {w} stderr:\n{err}"
            assert out.split() == (["acked"] if mode == "stay" else ["closed", "True"]), out
        with pytest.raises(TimeoutError):
            server.sample(timeout=0.05)  # nothing more than what was sent
        info = _connections(server, 0)
        assert info.samples_inserted_total == total
        assert info.store_size == 0
    finally:
        _kill_all(procs)


# --- TcpClient: connecting and the handshake -----------------------------------------------


class FakeServer:
    """A plain-socket server on 127.0.0.1 that answers one connection with `reply`, then
    (if `hold`) keeps it open until the client hangs up, then closes."""

    def __init__(self, reply: bytes, *, hold: bool = True) -> None:
        self._reply = reply
        self._hold = hold
        self._listener = socket.create_server((LOCALHOST, 0))
        self._listener.settimeout(WAIT_S)
        self.port: int = self._listener.getsockname()[1]
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self._listener.accept()
            with conn:
                conn.settimeout(WAIT_S)
                if self._reply:
                    conn.sendall(self._reply)
                if self._hold:
                    for _ in range(1000):  # until the client closes (bounded)
                        if not conn.recv(4096):
                            break
        except (OSError, TimeoutError) as exc:
            self.error = exc

    def close(self) -> None:
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "fake server thread still running"
        self._listener.close()


@pytest.fixture
def fake_server() -> Iterator[Callable[..., FakeServer]]:
    servers: list[FakeServer] = []

    def make(reply: bytes, *, hold: bool = True) -> FakeServer:
        servers.append(FakeServer(reply, hold=hold))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def test_handshake_bytes_are_exactly_wire_v1_and_each_sample_is_acked(
    make_server: Any, batch_ids: Any
) -> None:
    server = _started(make_server, batch_size=2)
    with _raw_connect(server.port) as sock:
        _read_greeting(sock)
        sock.sendall(_raw_sample(7) + _raw_sample(8))
        assert recv_exact(sock, 2) == b"\x01\x01"
        assert batch_ids(server.sample(timeout=WAIT_S).batch) == [7, 8]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("leaf", "bad"),
    [
        ("obs", np.zeros((4,), np.float32)),  # shape
        ("obs", np.zeros((3, 1), np.float32)),  # rank
        ("obs", np.zeros((3,), np.float64)),  # element size
        ("id", np.zeros((), np.int32)),  # element size
        ("id", np.zeros((1,), np.int64)),  # 0-d vs 1-d
    ],
    ids=["shape", "rank", "obs-dtype-size", "id-dtype-size", "id-ndim"],
)
def test_client_with_another_layout_is_a_value_error_naming_the_leaf(
    make_server: Any, example: Any, leaf: str, bad: np.ndarray
) -> None:
    server = _started(make_server)
    wrong = {**example, leaf: bad}
    with pytest.raises(ValueError, match=rf"\['{leaf}'\]"):
        TcpClient(LOCALHOST, server.port, wrong)
    # The server is unharmed: a matching client still connects.
    TcpClient(LOCALHOST, server.port, example).close()


@pytest.mark.parametrize(
    "extra", [{"z": np.zeros((1,), np.float32)}, None], ids=["more-leaves", "fewer-leaves"]
)
def test_client_with_another_leaf_count_is_a_value_error(
    make_server: Any, example: Any, extra: dict[str, np.ndarray] | None
) -> None:
    server = _started(make_server)
    wrong = {**example, **extra} if extra else {"obs": example["obs"]}
    with pytest.raises(ValueError, match="leaves"):
        TcpClient(LOCALHOST, server.port, wrong)


@pytest.mark.parametrize(
    "reply",
    [b"NOPE\x01" + bytes(64), b"ECHO\x02" + HANDSHAKE[5:], b"HTTP/1.1 400 Bad Request\r\n\r\n"],
    ids=["magic", "version", "http"],
)
def test_a_server_that_is_not_echo_v1_is_a_value_error(
    fake_server: Any, example: Any, reply: bytes
) -> None:
    fake = fake_server(reply)
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"magic|version"):
        TcpClient(LOCALHOST, fake.port, example)
    assert time.monotonic() - started < WAIT_S / 2


@pytest.mark.parametrize(
    "reply", [b"", b"ECH", HANDSHAKE[:9], HANDSHAKE[:-1]], ids=["nothing", "3", "9", "all-but-1"]
)
def test_a_server_that_closes_during_the_handshake_is_connection_closed(
    fake_server: Any, example: Any, reply: bytes
) -> None:
    fake = fake_server(reply, hold=False)
    with pytest.raises(ConnectionClosedError):
        TcpClient(LOCALHOST, fake.port, example)


def test_connection_refused_is_connection_refused_error(example: Any) -> None:
    # A bound but not listening socket: its port refuses connections, and nobody can take it.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOCALHOST, 0))
        port = sock.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(ConnectionRefusedError):
            TcpClient(LOCALHOST, port, example)
        assert time.monotonic() - started < WAIT_S / 2


def test_connection_closed_error_is_a_connection_error() -> None:
    assert issubclass(ConnectionClosedError, ConnectionError)
    assert echo.ConnectionClosedError is ConnectionClosedError


def test_a_server_that_never_sends_the_handshake_is_a_timeout_error(
    fake_server: Any, example: Any
) -> None:
    fake = fake_server(b"")  # accepts, then says nothing until we hang up
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        TcpClient(LOCALHOST, fake.port, example, connect_timeout=0.3)
    assert time.monotonic() - started < WAIT_S / 2


def test_client_resolves_host_names(
    make_server: Any, example: Any, make_sample: Any, batch_ids: Any
) -> None:
    server = _started(make_server, batch_size=2)
    with TcpClient("localhost", server.port, example) as client:
        client.send_many(make_sample(i) for i in range(2))
    assert take(server, 1, batch_ids) == [0, 1]


# --- TcpClient: send, wait, close ----------------------------------------------------------


def test_send_after_the_server_closed_raises_connection_closed(
    make_server: Any, example: Any, make_sample: Any, batch_ids: Any
) -> None:
    server, client = _started_with_client(make_server, example, batch_size=2)
    try:
        client.send(make_sample(0))
        client.send(make_sample(1))
        client.wait(timeout=WAIT_S)
        assert batch_ids(server.sample(timeout=WAIT_S).batch) == [0, 1]  # type: ignore[union-attr]
        server.close()
        started = time.monotonic()
        with pytest.raises(ConnectionClosedError):  # noqa: PT012 - the bounded retry is the point
            for i in range(10_000):
                client.send(make_sample(2 + i), timeout=WAIT_S)
                assert time.monotonic() - started < 5.0, f"{i + 1} sends after close() worked"
                time.sleep(0.005)
        assert time.monotonic() - started < 5.0
        # It stays closed.
        with pytest.raises(ConnectionClosedError):
            client.send(make_sample(0))
        if client.acked < client.sent:  # a send that went out just before the loss was seen
            with pytest.raises(ConnectionClosedError):
                client.wait(timeout=WAIT_S)
    finally:
        client.close(timeout=1.0)


# A server whose ring and ingress fill after a handful of samples (nobody samples).
_FULL_RING = {"batch_size": 2, "num_buffers": 2, "num_drainers": 1, "producer_queue_size": 1}


def _full_ring_server(make_server: Any) -> Server:
    return _started(make_server, **_FULL_RING)


@contextlib.contextmanager
def _client_of_a_full_ring(
    make_server: Any,
    example: Any,
    make_sample: Any,
    *,
    window: int = 64,
    sent: int = 0,
    must_flush: bool = False,
) -> Iterator[tuple[Server, TcpClient]]:
    """A `_full_ring_server` and a client of it that has sent `make_sample(0..sent)`. The
    client is closed at the end; with `must_flush`, that close must flush every ack."""
    server, client = _started_with_client(make_server, example, window, **_FULL_RING)
    try:
        for i in range(sent):
            client.send(make_sample(i), timeout=WAIT_S)
        yield server, client
    finally:
        flushed = client.close(timeout=WAIT_S if must_flush else 1.0)
    assert flushed or not must_flush, "close() did not flush every ack"


def _assert_close_ends_it_with_connection_closed(server: Server, worker: Any) -> None:
    """Closes `server` under `worker`'s blocked client call, which must raise within 3 s."""
    started = time.monotonic()
    server.close()
    with pytest.raises(ConnectionClosedError):
        worker.finish(WAIT_S)
    assert time.monotonic() - started < 3.0


def test_default_queue_holds_64_kib_of_samples_per_connection(
    make_server: Any, example: Any, make_sample: Any
) -> None:
    """`producer_queue_size=None` sizes each connection's queue by bytes: a connection of
    small samples gets 256 acknowledged ahead of a full ring (a queue of 8 stopped it at
    ~20), large samples keep 8, and a given size is kept."""
    assert make_server(np.zeros(4096, np.uint8)).producer_queue_size == 16
    assert make_server({"x": np.zeros(200_000, np.uint8)}).producer_queue_size == 8
    assert make_server(producer_queue_size=3).producer_queue_size == 3
    settings = {**_FULL_RING, "producer_queue_size": None}
    server, client = _started_with_client(make_server, example, 1024, **settings)
    assert server.producer_queue_size == 256
    try:
        for i in range(600):
            client.send(make_sample(i), timeout=WAIT_S)
        # Nobody samples: the ring (4) and the one drainer's round stop; the queue fills.
        last, stable_since = -1, time.monotonic()
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and time.monotonic() - stable_since < BLOCKED_S:
            if client.acked != last:
                last, stable_since = client.acked, time.monotonic()
            time.sleep(0.01)
        # Acknowledged: the ring's 4, what the drainer holds, and a full queue of 256.
        assert 256 <= client.acked <= 2 * 256 + 4, client.acked
    finally:
        client.close(timeout=1.0)


def test_send_blocked_on_the_inflight_limit_raises_when_the_server_closes(
    make_server: Any, example: Any, make_sample: Any, spawn: Any
) -> None:
    sent: list[int] = []
    with _client_of_a_full_ring(make_server, example, make_sample, window=2) as (server, client):

        def send_until_blocked() -> None:
            for i in range(1000):
                client.send(make_sample(i), timeout=3 * WAIT_S)
                sent.append(i)

        worker = spawn(send_until_blocked)
        # Wait until the count stops moving: the sender is blocked on the window.
        last, stable_since = -1, time.monotonic()
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and worker.is_alive():
            if len(sent) != last:
                last, stable_since = len(sent), time.monotonic()
            elif time.monotonic() - stable_since > BLOCKED_S:
                break
            time.sleep(0.01)
        assert worker.is_alive(), f"send never blocked: {worker.error!r}, {len(sent)} sent"
        assert 0 < len(sent) < 20
        _assert_close_ends_it_with_connection_closed(server, worker)


def test_wait_blocked_on_acks_raises_when_the_server_closes(
    make_server: Any, example: Any, make_sample: Any, spawn: Any
) -> None:
    with _client_of_a_full_ring(make_server, example, make_sample, sent=30) as (server, client):
        worker = spawn(client.wait, 3 * WAIT_S)
        # No counter shows a blocked wait(): it must still run after BLOCKED_S.
        assert_blocked(worker, after(BLOCKED_S), "wait() with a full ring")
        _assert_close_ends_it_with_connection_closed(server, worker)


def test_wait_times_out_while_the_ring_is_full_and_returns_once_all_are_acked(
    make_server: Any, example: Any, make_sample: Any, batch_ids: Any
) -> None:
    ring = _client_of_a_full_ring(make_server, example, make_sample, sent=30, must_flush=True)
    with ring as (server, client):
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            client.wait(timeout=0.2)
        assert 0.15 < time.monotonic() - started < 2.0
        assert client.sent == 30
        assert client.acked < 30
        ids = take(server, 15, batch_ids)
        assert ids == list(range(30))
        client.wait(timeout=WAIT_S)
        assert client.acked == client.sent == 30


def test_close_flushes_and_send_after_close_raises(
    make_server: Any, example: Any, make_sample: Any, batch_ids: Any
) -> None:
    server, client = _started_with_client(make_server, example, batch_size=4)
    for i in range(8):
        client.send(make_sample(i))
    assert client.close(timeout=WAIT_S) is True
    assert client.acked == client.sent == 8
    assert take(server, 2, batch_ids) == list(range(8))
    with pytest.raises(ConnectionClosedError):
        client.send(make_sample(8))
    assert client.sent == 8
    # Idempotent.
    assert client.close() is True
    assert client.close(timeout=0) is True
    _connections(server, 0)


def test_context_manager_closes_and_flushes(
    make_server: Any, example: Any, make_sample: Any, batch_ids: Any
) -> None:
    server = _started(make_server, batch_size=4)
    with TcpClient(LOCALHOST, server.port, example) as client:
        client.send_many(make_sample(i) for i in range(4))
    with pytest.raises(ConnectionClosedError):
        client.send(make_sample(4))
    assert take(server, 1, batch_ids) == [0, 1, 2, 3]


def _bad_samples(make_sample: Callable[[int], dict[str, Any]]) -> list[tuple[Any, type]]:
    good = make_sample(-1)
    return [
        ({**good, "obs": np.zeros((4,), np.float32)}, ValueError),  # shape
        ({**good, "obs": np.zeros((1, 3), np.float32)}, ValueError),  # rank
        ({**good, "id": np.zeros((1,), np.int64)}, ValueError),  # 0-d leaf given as 1-d
        ({**good, "obs": np.zeros((3,), np.float64)}, TypeError),  # dtype, other size
        ({**good, "obs": np.zeros((3,), np.int32)}, TypeError),  # dtype, same size
        ({**good, "id": -1}, TypeError),  # not an array
        ({"obs": good["obs"]}, ValueError),  # missing key
        ({**good, "extra": np.zeros((1,), np.float32)}, ValueError),  # extra key
        ({"id": good["id"], "obz": good["obs"]}, ValueError),  # renamed key
        ([good["id"], good["obs"]], ValueError),  # another container
        ({**good, "obs": {"x": good["obs"]}}, ValueError),  # a subtree where a leaf belongs
        ({**good, "obs": None}, ValueError),  # None is an empty subtree in optree
    ]


def test_bad_samples_raise_and_put_nothing_on_the_wire(
    make_server: Any, example: Any, make_sample: Any, batch_ids: Any
) -> None:
    server, client = _started_with_client(make_server, example, batch_size=4)
    try:
        good_ids = iter(range(100))
        sent: list[int] = []
        for bad, error in _bad_samples(make_sample):
            with pytest.raises(error):
                client.send(bad)
            assert client.sent == len(sent), f"{bad!r} was counted as sent"
            i = next(good_ids)
            client.send(make_sample(i))
            sent.append(i)
        while len(sent) % 4:
            sent.append(next(good_ids))
            client.send(make_sample(sent[-1]))
        client.wait(timeout=WAIT_S)
        assert client.sent == client.acked == len(sent)
        assert take(server, len(sent) // 4, batch_ids) == sent
        with pytest.raises(TimeoutError):
            server.sample(timeout=0.1)
    finally:
        client.close(timeout=WAIT_S)
    _connections(server, 0)
    assert server.stats().samples_inserted_total == len(sent)


def test_client_argument_checks(make_server: Any, example: Any) -> None:
    server = _started(make_server)
    with pytest.raises(ValueError, match="max_inflight_msgs"):
        TcpClient(LOCALHOST, server.port, example, max_inflight_msgs=0)
    with pytest.raises(TypeError, match="max_inflight_msgs"):
        TcpClient(LOCALHOST, server.port, example, max_inflight_msgs=True)
    with pytest.raises(TypeError):
        TcpClient(LOCALHOST, server.port, {"id": 1})


def test_close_with_a_timeout_gives_up_when_acks_do_not_come(
    make_server: Any, example: Any, make_sample: Any, batch_ids: Any
) -> None:
    server = _full_ring_server(make_server)
    client = TcpClient(LOCALHOST, server.port, example, max_inflight_msgs=64)
    for i in range(30):
        client.send(make_sample(i), timeout=WAIT_S)
    started = time.monotonic()
    assert client.close(timeout=0.2) is False  # the ring is full: not everything is acked
    assert 0.15 < time.monotonic() - started < 2.0
    with pytest.raises(ConnectionClosedError):
        client.send(make_sample(30))
    assert client.close(timeout=0.2) is False
    acked = client.acked
    assert 0 < acked < 30
    # What the server acknowledged before the client left still arrives, in order (and so
    # may more of what was on the wire: the server reads the socket until its end).
    ids: list[int] = []
    for _ in range(20):
        try:
            sample = server.sample(timeout=1.0)
        except TimeoutError:
            break
        assert sample is not None
        ids += batch_ids(sample.batch)
    assert ids == list(range(len(ids)))
    info = _connections(server, 0)
    assert info.samples_inserted_total >= acked
    assert info.samples_inserted_total == len(ids) + info.store_size


def test_threads_sharing_one_client_never_interleave_samples(
    make_server: Any, example: Any, make_sample: Any, batch_ids: Any, spawn: Any
) -> None:
    server = _started(make_server, batch_size=4)
    client = TcpClient(LOCALHOST, server.port, example, max_inflight_msgs=8)
    num_threads, per_thread = 4, 100

    def send(t: int) -> None:
        for seq in range(per_thread):
            client.send(make_sample(t * 1000 + seq), timeout=WAIT_S)

    try:
        senders = [spawn(send, t) for t in range(num_threads)]
        ids = take(server, num_threads * per_thread // 4, batch_ids)
        for sender in senders:
            sender.finish(WAIT_S)
        for t in range(num_threads):
            assert [i % 1000 for i in ids if i // 1000 == t] == list(range(per_thread))
        assert len(ids) == len(set(ids))
    finally:
        assert client.close(timeout=WAIT_S) is True
    assert client.sent == client.acked == num_threads * per_thread


@pytest.mark.parametrize("n", [1, 5_000, 40_000], ids=["small", "40KB", "320KB"])
def test_mixed_dtypes_and_large_payloads_arrive_intact(make_server: Any, n: int) -> None:
    """Leaf order, dtypes and every byte survive, for payloads below, around and above the
    transport's staging buffer, and from non-contiguous and Fortran-ordered inputs."""
    example = {
        "a": np.zeros((7,), np.uint8),
        "b": np.zeros((n,), np.float64),
        "c": np.zeros((3, 5), np.int16),
        "d": {"e": np.zeros((), np.bool_)},
    }

    def make(i: int) -> dict[str, Any]:
        b = np.arange(2 * n, dtype=np.float64) + i * 1e6
        return {
            "a": ((np.arange(7) + i) % 256).astype(np.uint8),
            "b": b[::2] if i % 2 else b[:n],  # every other one is a strided view
            "c": np.asfortranarray(np.arange(15, dtype=np.int16).reshape(3, 5) + i),
            "d": {"e": np.array(i % 3 == 0)},
        }

    batch_size, num_samples = 3, 12
    server = _started(make_server, ex=example, batch_size=batch_size)
    with TcpClient(LOCALHOST, server.port, example, max_inflight_msgs=4) as client:
        for i in range(num_samples):
            client.send(make(i), timeout=WAIT_S)
            if i % batch_size == batch_size - 1:
                sample = server.sample(timeout=WAIT_S)
                assert sample is not None
                for k in range(batch_size):
                    want = make(i - batch_size + 1 + k)
                    got = sample.batch
                    np.testing.assert_array_equal(got["a"][k], want["a"])
                    np.testing.assert_array_equal(got["b"][k], want["b"])
                    np.testing.assert_array_equal(got["c"][k], want["c"])
                    assert bool(got["d"]["e"][k]) == bool(want["d"]["e"])
                assert sample.batch["b"].dtype == np.float64
                assert sample.batch["c"].shape == (batch_size, 3, 5)


@pytest.mark.parametrize(
    ("n", "window"), [(1 << 20, 64), (1 << 16, 2)], ids=["4MB-mid-sample", "256KB-window"]
)
def test_send_with_a_timeout_sends_a_whole_sample_or_nothing(
    make_server: Any, spawn: Any, n: int, window: int
) -> None:
    """While nobody samples, the sender runs into a full window (256 KB samples, window 2) or
    a full socket in the middle of a sample (4 MB samples). `send(timeout=...)` must either
    send the whole sample or nothing: what it reports as sent arrives whole and in order,
    and nothing else arrives."""
    example = {"id": np.zeros((), np.int64), "obs": np.zeros((n,), np.float32)}
    server = _started(
        make_server,
        ex=example,
        batch_size=1,
        num_buffers=2,
        num_drainers=1,
        producer_queue_size=1,
    )
    received: list[int] = []
    stop = threading.Event()
    # Set by the sender on its first TimeoutError; `sending_since` is when the send() now in
    # progress began (None between sends). The consumer starts only once the sender has
    # reached the state this test is about: a send that timed out (or, mid-sample with the
    # larger window, one blocked for longer than its timeout). A condition, not a sleep, so a
    # slow start on a busy machine cannot let the consumer drain the ring first.
    timed_out = threading.Event()
    sending_since: list[float | None] = [None]

    def stalled() -> bool:
        since = sending_since[0]
        long_send = window != 2 and since is not None and time.monotonic() - since > 0.6
        return timed_out.is_set() or long_send

    def consume() -> None:
        reached = time.monotonic() + 3 * WAIT_S
        while not stalled() and not stop.is_set() and time.monotonic() < reached:
            timed_out.wait(0.01)
        deadline = time.monotonic() + 3 * WAIT_S
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                sample = server.sample(timeout=0.1)
            except TimeoutError:
                continue
            if sample is None:
                return
            i = int(sample.batch["id"][0])
            obs = sample.batch["obs"][0]
            assert np.all(obs == np.float32(i)), f"sample {i} is torn: {obs[0]} .. {obs[-1]}"
            received.append(i)

    consumer = spawn(consume)
    client = TcpClient(LOCALHOST, server.port, example, max_inflight_msgs=window)
    sent: list[int] = []
    timeouts, longest = 0, 0.0
    try:
        for i in range(16):
            sample = {"id": np.array(i, np.int64), "obs": np.full((n,), i, np.float32)}
            began = time.monotonic()
            sending_since[0] = began
            try:
                client.send(sample, timeout=0.2)
            except TimeoutError:
                timeouts += 1
                timed_out.set()
            else:
                sent.append(i)
            sending_since[0] = None
            longest = max(longest, time.monotonic() - began)
        assert client.close(timeout=2 * WAIT_S) is True
        assert client.sent == len(sent)
        poll(lambda: len(received), lambda k: k >= len(sent), "all sent samples received")
    finally:
        stop.set()
        consumer.finish(4 * WAIT_S)
    assert received == sent
    # The test did reach the state it is about.
    assert timeouts > 0 or longest > 0.5, (timeouts, longest)
    if window == 2:
        assert timeouts > 0


CLIENT_PRELUDE = textwrap.dedent(
    """
    import sys, threading
    import numpy as np
    import echo

    EXAMPLE = {"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}

    def make_sample(i):
        return {"id": np.array(i, np.int64), "obs": np.full((3,), i, np.float32)}

    # Nobody samples: the ring and the ingress fill after a few samples.
    server = echo.Server(
        EXAMPLE, batch_size=1, num_buffers=2, num_drainers=1, producer_queue_size=1,
        transport=echo.TcpTransport(port=0, host="127.0.0.1"),
    )
    server.start()
    client = echo.TcpClient("127.0.0.1", server.port, EXAMPLE, max_inflight_msgs=2)
    """
)


@pytest.mark.serial
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("blocked_in", ["send", "wait"])
def test_ctrl_c_interrupts_a_blocked_send_or_wait_promptly(blocked_in: str) -> None:
    # No counter shows a blocked TcpClient call: the child announces it after 0.5 s.
    body = {
        "send": """
            announce_when(after(0.5))
            for i in range(1000):
                client.send(make_sample(i))
            """,
        "wait": """
            for i in range(40):
                client.send(make_sample(i), timeout=5)
            announce_when(after(0.5))
            client.wait()
            """,
    }[blocked_in]
    prelude = CLIENT_PRELUDE
    if blocked_in == "wait":
        # A window wide enough that every send goes out and only wait() blocks.
        prelude = prelude.replace("max_inflight_msgs=2", "max_inflight_msgs=64")
    assert_ctrl_c_interrupts_promptly(
        "from _blocked import after, announce_when\n" + prelude + textwrap.dedent(body)
    )


def test_interpreter_exit_with_a_thread_blocked_in_send_is_clean(run_python: Any) -> None:
    proc = run_python(
        CLIENT_PRELUDE
        + textwrap.dedent(
            """
            def flood():
                for i in range(1000):
                    client.send(make_sample(i))

            thread = threading.Thread(target=flood, daemon=True)
            thread.start()
            thread.join(0.5)
            assert thread.is_alive()
            print("blocked", flush=True)
            """
        )
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "blocked"
    assert proc.stderr == ""


# --- Server and TcpTransport ---------------------------------------------------------------


def test_port_is_none_before_start_and_start_twice_is_harmless(
    make_server: Any, example: Any, make_sample: Any, batch_ids: Any
) -> None:
    server = make_server(transport=_tcp())
    assert server.port is None
    server.start()
    port = server.port
    assert isinstance(port, int)
    assert 0 < port < 65536
    server.start()
    assert server.port == port
    with TcpClient(LOCALHOST, port, example) as client:
        client.send_many(make_sample(i) for i in range(4))
    assert take(server, 1, batch_ids) == [0, 1, 2, 3]
    assert _connections(server, 0).active_connections == 0


def test_in_process_server_has_no_port(make_server: Any) -> None:
    server = make_server()
    server.start()
    assert server.port is None


def test_port_in_use_is_an_os_error_naming_the_port(make_server: Any) -> None:
    with socket.create_server((LOCALHOST, 0)) as taken:
        port = taken.getsockname()[1]
        server = make_server(transport=TcpTransport(port=port, host=LOCALHOST))
        with pytest.raises(OSError, match=str(port)):
            server.start()
        assert server.port is None
    # ... also when an echo server holds it.
    first = _started(make_server)
    second = make_server(transport=TcpTransport(port=first.port, host=LOCALHOST))
    with pytest.raises(OSError, match=str(first.port)):
        second.start()


# Ids without an address in them (`object()`'s repr has one): pytest-xdist's workers must
# collect the same test ids.
@pytest.mark.parametrize(
    "transport",
    ["tcp", 50051, object(), {"port": 0}],
    ids=lambda v: "object()" if type(v) is object else repr(v),
)
def test_transport_of_a_wrong_type_is_a_type_error(
    make_server: Any, example: Any, transport: Any
) -> None:
    with pytest.raises(TypeError, match="transport"):
        Server(example, 4, transport=transport)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"port": -1}, ValueError),
        ({"port": 70000}, ValueError),
        ({"port": 65536}, ValueError),
        ({"port": 0, "num_threads": 0}, ValueError),
        ({"port": 0, "num_threads": -2}, ValueError),
        ({"port": 0, "max_connections": 0}, ValueError),
        ({"port": 0, "host": ""}, TypeError),
        ({"port": 0, "host": None}, TypeError),
        ({"port": 0, "host": b"127.0.0.1"}, TypeError),
        ({"port": True}, TypeError),
        ({"port": 0, "num_threads": True}, TypeError),
        ({"port": 0, "max_connections": False}, TypeError),
        ({"port": "50051"}, TypeError),
        ({"port": 1.5}, TypeError),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else v.__name__,
)
def test_tcp_transport_validates_its_arguments(kwargs: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        TcpTransport(**kwargs)


def test_tcp_transport_defaults() -> None:
    transport = TcpTransport(port=0)
    assert transport.host == "0.0.0.0"
    assert transport.num_threads == 8
    assert transport.max_connections >= 1
    assert TcpTransport(65535).port == 65535


def test_active_connections_follows_clients(make_server: Any, example: Any) -> None:
    server = _started(make_server)
    assert server.stats().active_connections == 0
    clients = [TcpClient(LOCALHOST, server.port, example) for _ in range(3)]
    try:
        _connections(server, 3)
        clients[1].close()
        _connections(server, 2)
        clients.append(TcpClient(LOCALHOST, server.port, example))
        _connections(server, 3)
    finally:
        for client in clients:
            client.close(timeout=WAIT_S)
    _connections(server, 0)


def test_inserted_and_notify_counts(
    make_server: Any, example: Any, make_sample: Any, batch_ids: Any
) -> None:
    n, batch_size = 42, 4
    server = _started(make_server, batch_size=batch_size, num_buffers=4)
    with TcpClient(LOCALHOST, server.port, example) as client:
        for i in range(n):
            client.send(make_sample(i), timeout=WAIT_S)
            if i % batch_size == batch_size - 1:
                assert batch_ids(server.sample(timeout=WAIT_S).batch)[-1] == i  # type: ignore[union-attr]
    info = _poll_stats(
        server, lambda s: s.samples_inserted_total == n, "samples_inserted_total == n"
    )
    assert info.notify_count == n // batch_size
    assert info.store_size == n % batch_size


def test_push_blocked_count_grows_when_the_consumer_stalls(
    make_server: Any, example: Any, make_sample: Any, batch_ids: Any
) -> None:
    ring = _client_of_a_full_ring(make_server, example, make_sample, sent=20, must_flush=True)
    with ring as (server, client):
        info = _poll_stats(server, lambda s: s.push_blocked_count > 0, "push_blocked_count > 0")
        assert info.samples_inserted_total <= 2 * 2 + 2  # the ring (+ a drainer's round)
        assert take(server, 10, batch_ids) == list(range(20))
        client.wait(timeout=WAIT_S)


def test_max_connections_refuses_extra_clients_cleanly(
    make_server: Any, example: Any, make_sample: Any, batch_ids: Any
) -> None:
    server = _started(make_server, batch_size=4, transport=_tcp(max_connections=2))
    # Over TCP, where a connection counts as working before its first acknowledgement is
    # written, so an acknowledged sample means "working". (On the shared-memory path the
    # acknowledgement can come first: that is not what this test is about.)
    tcp = {"shared_memory": False}
    first = TcpClient(LOCALHOST, server.port, example, **tcp)
    second = TcpClient(LOCALHOST, server.port, example, **tcp)
    clients = [first, second]
    try:
        # Working connections (each has completed a sample) are never evicted for a newcomer,
        # so a third client is refused; idle ones would be (see test_hardening.py).
        for i in range(2):
            first.send(make_sample(i))
            second.send(make_sample(100 + i))
        first.wait(timeout=WAIT_S)
        second.wait(timeout=WAIT_S)
        with pytest.raises(ConnectionClosedError):
            TcpClient(LOCALHOST, server.port, example, **tcp)
        _connections(server, 2)
        assert sorted(take(server, 1, batch_ids)) == [0, 1, 100, 101]
        # A slot that frees up can be taken again (the server notices the close shortly).
        first.close(timeout=WAIT_S)
        third = None
        for _ in range(200):
            try:
                third = TcpClient(LOCALHOST, server.port, example, **tcp)
                break
            except ConnectionClosedError:
                time.sleep(0.02)
        assert third is not None, "a freed connection slot was never given out again"
        clients.append(third)
        for i in range(2):
            second.send(make_sample(102 + i))
            third.send(make_sample(200 + i))
        ids = take(server, 1, batch_ids)
        assert sorted(ids) == [102, 103, 200, 201]
    finally:
        for client in clients:
            client.close(timeout=WAIT_S)


# --- robustness: bad peers do not disturb good ones ----------------------------------------


def _garbage_without_reading(port: int) -> None:
    """Connects, sends less than one sample of garbage without reading the handshake, leaves."""
    with _raw_connect(port) as sock:
        sock.sendall(bytes(range(13)))


def _garbage_after_whole_samples(port: int, ids: list[int]) -> None:
    """Sends whole samples `ids`, waits for their acks, then a torn one, then leaves."""
    with _raw_connect(port) as sock:
        _read_greeting(sock)
        sock.sendall(b"".join(_raw_sample(i) for i in ids))
        assert recv_exact(sock, len(ids)) == b"\x01" * len(ids)
        sock.sendall(b"\xff" * (PAYLOAD // 2 + 3))  # no multiple of the payload


def _dribble(port: int, i: int) -> None:
    """Sends sample `i` and a few more bytes one byte at a time, every 40 ms (about 1 s)."""
    with _raw_connect(port) as sock:
        _read_greeting(sock)
        for byte in _raw_sample(i) + b"\x07" * 5:
            sock.sendall(bytes([byte]))
            time.sleep(0.04)
        assert recv_exact(sock, 1) == b"\x01"


def test_garbage_stalled_and_dribbling_peers_do_not_disturb_a_good_client(
    make_server: Any, example: Any, make_sample: Any, batch_ids: Any, spawn: Any
) -> None:
    batch_size = 4
    server = _started(make_server, batch_size=batch_size)
    port = server.port
    garbage_ids = [900_000, 900_001, 900_002]
    dribbled = 800_000
    silent = _raw_connect(port)  # connects and never sends
    try:
        bad_peers = [
            spawn(_garbage_without_reading, port),
            spawn(_garbage_after_whole_samples, port, garbage_ids),
            spawn(_dribble, port, dribbled),
        ]

        def good_client() -> None:
            with TcpClient(LOCALHOST, port, example) as client:
                for i in range(200):
                    client.send(make_sample(i), timeout=WAIT_S)

        good = spawn(good_client)
        expected = [*range(200), *garbage_ids, dribbled]
        assert len(expected) % batch_size == 0
        ids = take(server, len(expected) // batch_size, batch_ids)
        counts = collections.Counter(ids)
        assert sorted(counts) == sorted(expected)
        assert set(counts.values()) == {1}, {i: c for i, c in counts.items() if c != 1}
        assert [i for i in ids if i < 200] == list(range(200))
        assert [i for i in ids if i in garbage_ids] == garbage_ids
        good.finish(WAIT_S)
        for peer in bad_peers:
            peer.finish(WAIT_S)
        assert server.stats().active_connections >= 1  # the silent one is still there
    finally:
        silent.close()
    info = _connections(server, 0)
    # The torn tails were discarded, never stored.
    assert info.samples_inserted_total == len(expected)
    assert info.store_size == 0
    with pytest.raises(TimeoutError):
        server.sample(timeout=0.1)


def test_a_burst_of_connections_leaves_no_trace(
    make_server: Any, example: Any, make_sample: Any, batch_ids: Any
) -> None:
    server = _started(make_server, batch_size=4)
    socks: list[socket.socket] = []
    try:
        for _ in range(200):
            socks.append(_raw_connect(server.port))
        _connections(server, 200)
    finally:
        for sock in socks:
            sock.close()
    _connections(server, 0)
    # And a short-lived connection burst that does not even wait to be served.
    for _ in range(200):
        _raw_connect(server.port).close()
    info = _connections(server, 0)
    assert info.samples_inserted_total == 0
    with TcpClient(LOCALHOST, server.port, example) as client:
        client.send_many(make_sample(i) for i in range(4))
    assert take(server, 1, batch_ids) == [0, 1, 2, 3]


# --- lifecycle ------------------------------------------------------------------------------

LEAK_SCRIPT = textwrap.dedent(
    """
    import gc, os, sys, threading, time
    import numpy as np
    import echo

    EXAMPLE = {"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}

    def make_sample(i):
        return {"id": np.array(i, np.int64), "obs": np.full((3,), i, np.float32)}

    def counts():
        tasks = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0
        fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
        return threading.active_count(), tasks, fds

    def settle(baseline):
        deadline = time.monotonic() + 5.0
        for _ in range(1000):
            gc.collect()
            now = counts()
            if now == baseline or time.monotonic() > deadline:
                return now
            time.sleep(0.01)
        return counts()

    def rss_kib():
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    baseline = counts()
    rss_warm = 0
    for n in range(100):
        if n == 10:
            gc.collect()
            rss_warm = rss_kib()
        server = echo.Server(
            EXAMPLE, batch_size=4, transport=echo.TcpTransport(port=0, host="127.0.0.1")
        )
        server.start()
        client = echo.TcpClient("127.0.0.1", server.port, EXAMPLE)
        for i in range(4):
            client.send(make_sample(i))
        batch = server.sample(timeout=10).batch
        assert batch["id"].tolist() == [0, 1, 2, 3], batch["id"]
        if n % 3 == 0:
            assert client.close(timeout=10) is True
            server.close()
        elif n % 3 == 1:
            server.close()  # the server goes first: the client notices and closes quickly
            client.close(timeout=10)
        # else: neither is closed; dropping them must release everything too
        del server, client, batch
    after = settle(baseline)
    print("baseline", baseline, "after", after)
    assert after == baseline, f"threads/tasks/fds: baseline {baseline}, after 100 rounds {after}"
    grown = rss_kib() - rss_warm
    assert grown < 16 * 1024, f"RSS grew by {grown} KiB over 90 server lifetimes"
    print("ok")
    """
)


def test_a_hundred_server_client_rounds_leak_no_threads_fds_or_memory(run_python: Any) -> None:
    proc = run_python(LEAK_SCRIPT, timeout=100)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.stdout.strip().endswith("ok"), proc.stdout
    assert proc.stderr == "", proc.stderr


# --- compatibility with the published id-echo 0.2.1 -----------------------------------------

PEER_VERSION = "0.2.1"
PEER_VENV = HERE.parents[1] / "target" / "peer-venv"
PEER_SETUP_TIMEOUT_S = 300.0


def _peer_env() -> dict[str, str]:
    """Our environment without anything that would make the peer import our `echo`."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONUSERBASE"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONNOUSERSITE"] = "1"
    env["PYTHONSAFEPATH"] = "1"
    return env


def _peer_version(python: str, cwd: Path) -> tuple[str | None, str]:
    """(`echo.__version__` as `python` sees it, or None; diagnostics)."""
    try:
        proc = subprocess.run(
            [python, "-c", "import echo; print(echo.__version__); print(echo.__file__)"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=cwd,
            env=_peer_env(),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, repr(exc)
    lines = proc.stdout.split()
    if proc.returncode != 0 or not lines:
        return None, proc.stderr[-2000:]
    return lines[0], proc.stdout


@pytest.fixture(scope="session")
def peer_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Python with id-echo 0.2.1: $ECHO_PEER_PYTHON, or a virtualenv built once under
    target/peer-venv (skips, with the reason, when that cannot be done)."""
    cwd = tmp_path_factory.mktemp("peer-cwd")
    configured = os.environ.get("ECHO_PEER_PYTHON")
    if configured:
        version, detail = _peer_version(configured, cwd)
        if version != PEER_VERSION:
            pytest.fail(
                f"ECHO_PEER_PYTHON={configured} does not import id-echo {PEER_VERSION}: "
                f"got {version!r}\n{detail}"
            )
        return configured
    # One process builds it at a time: pytest-xdist runs this session fixture once per
    # worker, and two `venv --clear` of one directory at once break each other.
    PEER_VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(PEER_VENV.parent / "peer-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _peer_venv(cwd)


def _peer_venv(cwd: Path) -> str:
    """`peer_python`'s virtualenv, built unless it is there and imports id-echo 0.2.1."""
    python = PEER_VENV / "bin" / "python"
    if python.exists() and _peer_version(str(python), cwd)[0] == PEER_VERSION:
        return str(python)
    deadline = time.monotonic() + PEER_SETUP_TIMEOUT_S
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(PEER_VENV)],
        [str(python), "-m", "pip", "install", "-q", f"id-echo=={PEER_VERSION}", "numpy", "optree"],
    ]
    for step in steps:
        left = deadline - time.monotonic()
        try:
            proc = subprocess.run(
                step,
                capture_output=True,
                text=True,
                timeout=max(left, 1.0),
                cwd=cwd,
                env=_peer_env(),
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"cannot set up id-echo {PEER_VERSION} in {PEER_VENV}: {exc!r}")
        if proc.returncode != 0:
            pytest.skip(
                f"cannot set up id-echo {PEER_VERSION} in {PEER_VENV}: {' '.join(step)} "
                f"exited {proc.returncode}: {proc.stderr[-1000:]}"
            )
    version, detail = _peer_version(str(python), cwd)
    if version != PEER_VERSION:
        pytest.skip(f"{PEER_VENV} does not import id-echo {PEER_VERSION}: {detail}")
    return str(python)


PEER_PRELUDE = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import echo

    assert echo.__version__ == "0.2.1", echo.__version__
    assert "/work/main/python" not in echo.__file__, echo.__file__
    EXAMPLE = {"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}

    def make_sample(i):
        return {"id": np.array(i, np.int64), "obs": np.full((3,), i, np.float32)}
    """
)

PEER_CLIENT = PEER_PRELUDE + textwrap.dedent(
    """
    port = int(sys.argv[1])
    try:
        echo.TcpClient("127.0.0.1", port, {**EXAMPLE, "obs": np.zeros((4,), np.float32)})
    except ValueError as exc:
        print("mismatch", type(exc).__name__, flush=True)
    client = echo.TcpClient("127.0.0.1", port, EXAMPLE, max_inflight_msgs=8)
    for i in range(100):
        client.send(make_sample(i))
    client.wait()
    client.close()
    print("sent", flush=True)
    """
)

PEER_SERVER = PEER_PRELUDE + textwrap.dedent(
    """
    server = echo.Server(EXAMPLE, 10, transport=echo.TcpTransport(0))
    server.start()
    print("port", server.port, flush=True)
    for _ in range(10):
        batch = server.sample().batch
        print("ids", json.dumps(batch["id"].tolist(), separators=(",", ":")),
              json.dumps(batch["obs"].tolist(), separators=(",", ":")), flush=True)
    server.close()
    print("done", flush=True)
    """
)


@pytest.mark.peer
def test_peer_client_sends_to_our_server(
    make_server: Any, batch_ids: Any, peer_python: str, tmp_path: Path
) -> None:
    server = _started(make_server, batch_size=10)
    proc = subprocess.Popen(
        [peer_python, "-c", PEER_CLIENT, str(server.port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=_peer_env(),
    )
    try:
        try:
            ids = take(server, 10, batch_ids)
        except TimeoutError:
            proc.kill()
            out, err = proc.communicate(timeout=WAIT_S)
            pytest.fail(f"no batch from the peer client; stdout {out!r}, stderr:\n{err}")
        assert ids == list(range(100))
        out, err = proc.communicate(timeout=3 * WAIT_S)
        assert proc.returncode == 0, err
        assert out.split() == ["mismatch", "ValueError", "sent"], (out, err)
        with pytest.raises(TimeoutError):
            server.sample(timeout=0.1)
        info = _connections(server, 0)
        assert info.samples_inserted_total == 100
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=WAIT_S)


class LineReader:
    """Reads a process's stdout lines on a daemon thread, so each can be awaited with a
    timeout (`readline` on a pipe has none)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self._stdout = proc.stdout
        self._lines: queue.Queue[str] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for line in self._stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put("")  # EOF

    def get(self, timeout: float) -> str | None:
        """The next line, "" at EOF, None if none came within `timeout`."""
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def join(self) -> None:
        self._thread.join(WAIT_S)


@pytest.mark.peer
def test_our_client_sends_to_the_peer_server(
    example: Any, make_sample: Any, peer_python: str, tmp_path: Path
) -> None:
    proc = subprocess.Popen(
        [peer_python, "-c", PEER_SERVER],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=_peer_env(),
    )
    lines = LineReader(proc)
    client = None
    try:
        line = lines.get(3 * WAIT_S)
        if not (line or "").startswith("port "):
            proc.kill()
            _, err = proc.communicate(timeout=WAIT_S)
            pytest.fail(f"peer server did not start: {line!r}, stderr:\n{err}")
        port = int((line or "").split()[1])
        with pytest.raises(ValueError, match=r"\['obs'\]"):
            TcpClient(LOCALHOST, port, {**example, "obs": np.zeros((4,), np.float32)})
        client = TcpClient(LOCALHOST, port, example, max_inflight_msgs=8)
        for i in range(100):
            client.send(make_sample(i), timeout=WAIT_S)
        client.wait(timeout=WAIT_S)
        # Stay connected until the peer has handed out every batch.
        ids: list[int] = []
        deadline = time.monotonic() + 3 * WAIT_S
        for _ in range(11):
            line = lines.get(max(deadline - time.monotonic(), 0.01))
            if line in ("done", "", None):
                break
            tag, id_json, obs_json = line.split(" ", 2)
            assert tag == "ids", line
            batch = json.loads(id_json)
            assert json.loads(obs_json) == [[float(i)] * 3 for i in batch]
            ids += batch
        assert line == "done", f"peer stopped at {line!r} after ids {ids}"
        assert ids == list(range(100))
        assert client.close(timeout=WAIT_S) is True
        _, err = proc.communicate(timeout=WAIT_S)
        assert proc.returncode == 0, err
    finally:
        if client is not None:
            client.close(timeout=1.0)
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=WAIT_S)
        lines.join()


def test_samples_just_under_the_detach_threshold_survive_a_socket_full_mid_sample(
    make_server: Any,
) -> None:
    # ~60 KiB samples take the GIL-held fast path; with a wide window the socket fills in the
    # middle of one. The write must resume, not be abandoned (which would splice two samples).
    width = 60 * 1024 // 4
    example = {"x": np.zeros((width,), np.float32), "id": np.zeros((), np.int64)}
    server = make_server(
        example, batch_size=8, num_buffers=2, transport=_tcp(), producer_queue_size=2
    )
    server.start()
    total = 160

    def produce() -> None:
        with TcpClient(LOCALHOST, server.port, example, max_inflight_msgs=256) as client:
            for i in range(total):
                client.send({"x": np.full((width,), i, np.float32), "id": np.array(i)})

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    time.sleep(0.5)  # let the socket buffers fill while nobody samples
    seen = []
    for _ in range(total // 8):
        got = server.sample(timeout=30)
        assert got is not None
        for x, i in zip(got.batch["x"], got.batch["id"], strict=True):
            assert (x == i).all(), f"sample {i} is spliced with another one"
            seen.append(int(i))
    producer.join(timeout=30)
    assert not producer.is_alive()
    assert seen == list(range(total))


# ~44 KB nested samples: above the 32 KiB from which the ingress reads in place.
_LARGE = {
    "obs": {"pixels": np.zeros((160, 250), np.uint8), "depth": np.zeros(997, np.float32)},
    "id": np.zeros((), np.int64),
}


def _large_sample(worker: int, i: int) -> dict[str, Any]:
    value = (worker * 31 + i) % 251
    return {
        "obs": {
            "pixels": np.full((160, 250), value, np.uint8),
            "depth": np.full(997, float(value), np.float32),
        },
        "id": np.array(worker * ID_STRIDE + i, np.int64),
    }


def _send_large(port: int, worker: int, n: int, protocol: int | str) -> None:
    with TcpClient(LOCALHOST, port, _LARGE, protocol=protocol) as client:
        for i in range(n):
            client.send(_large_sample(worker, i), timeout=WAIT_S)
            if i % 4 == 0:
                time.sleep(0.002)  # an idle connection: the next sample arrives whole


@pytest.mark.parametrize("sampler", ["fifo", "replay"])
def test_large_samples_read_in_place_arrive_once_in_order_and_intact(
    make_server: Any, sampler: str
) -> None:
    """Large samples a FIFO server reads straight from the socket into the ring
    (`samples_received_in_place_total`) arrive like the rest: every one once, in each
    worker's order, every byte right, from v1 and v2 clients at once. A replay table always
    takes the queue (its inserts take its lock); with `max_times_sampled=1` and room for
    every sample (nothing evicted), its draws hand out each item exactly once whatever the
    timing, so every sample must show up once, intact, though in no particular order."""
    workers, n, batch = 4, 60, 4
    replay: dict[str, Any] = {}
    if sampler == "replay":
        replay = {
            "sampler": echo.Uniform(),
            "max_size": workers * n,
            "max_times_sampled": 1,
            "seed": 24,
        }
    server = _started(make_server, ex=_LARGE, batch_size=batch, num_buffers=8, **replay)
    assert server.port is not None
    threads = [
        threading.Thread(target=_send_large, args=(server.port, w, n, 1 if w % 2 else "auto"))
        for w in range(workers)
    ]
    for t in threads:
        t.start()
    seen: dict[int, list[int]] = collections.defaultdict(list)
    for _ in range(workers * n // batch):
        sample = server.sample(timeout=WAIT_S)
        assert sample is not None
        for row in range(batch):
            worker, i = divmod(int(sample.batch["id"][row]), ID_STRIDE)
            expected = _large_sample(worker, i)
            assert np.array_equal(sample.batch["obs"]["pixels"][row], expected["obs"]["pixels"])
            assert np.array_equal(sample.batch["obs"]["depth"][row], expected["obs"]["depth"])
            seen[worker].append(i)
    for t in threads:
        t.join(timeout=WAIT_S)
    assert not any(t.is_alive() for t in threads)
    info = server.stats()
    assert info.samples_inserted_total == workers * n
    in_place = info.samples_received_in_place_total
    if sampler == "replay":
        assert in_place == 0
        # Uniform draws come in no order; each item once, as max_times_sampled=1 promises.
        assert {w: sorted(ids) for w, ids in seen.items()} == {
            w: list(range(n)) for w in range(workers)
        }
        return
    assert 0 < in_place <= workers * n, info
    assert seen == {w: list(range(n)) for w in range(workers)}
