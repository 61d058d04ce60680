"""Hostile and unlucky callers: inputs that lie about themselves, races between lifecycle
calls, absurd timeouts, peers that are not echo servers, and calls that must never hold the
GIL while they wait for a native lock (issue #11). Each test here failed before its fix."""

from __future__ import annotations

import socket
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import echo
from echo import ConnectionClosedError, Server, TcpClient, TcpTransport

LOCALHOST = "127.0.0.1"
WAIT_S = 10.0


# --- 1. leaves whose own methods lie ---------------------------------------------------------


class _LyingCopy(np.ndarray):  # type: ignore[type-arg]
    """An ndarray whose `copy()` returns a 1-byte array whatever it is asked for."""

    def copy(self, order: str = "C") -> Any:  # type: ignore[override]
        return np.zeros(1, np.uint8)


class _LyingScalar(np.float32):
    """A numpy scalar whose `__array__` returns a large array of another shape."""

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        return np.zeros(100_000, np.float32)


def _strided(values: np.ndarray, cls: type) -> np.ndarray:
    """`values` as a non-C-contiguous view of class `cls` (every other element)."""
    doubled = np.repeat(values, 2)
    return doubled[::2].view(cls)


def test_a_non_contiguous_leaf_is_copied_by_numpy_not_by_its_own_copy_method() -> None:
    n = 1000
    server = Server({"x": np.zeros(n, np.float32)}, batch_size=1)
    values = np.arange(n, dtype=np.float32)
    leaf = _strided(values, _LyingCopy)
    assert not leaf.flags.c_contiguous
    assert leaf.shape == (n,)
    server.submit({"x": leaf})
    got = server.sample(timeout=WAIT_S)
    assert got is not None
    np.testing.assert_array_equal(got.batch["x"][0], values)
    server.close()


def test_a_scalar_leaf_is_converted_by_numpy_whatever_its_array_method_says() -> None:
    # A guard rather than a regression test: numpy converts its own scalar types without
    # asking `__array__`, and the native side re-checks whatever a conversion returns.
    server = Server({"x": np.zeros((), np.float32)}, batch_size=1)
    server.submit({"x": _LyingScalar(1.5)})
    got = server.sample(timeout=WAIT_S)
    assert got is not None
    assert got.batch["x"].tolist() == [1.5]
    server.close()


def test_tcp_send_copies_a_lying_non_contiguous_leaf_correctly() -> None:
    n = 1000
    example = {"x": np.zeros(n, np.float32)}
    server = Server(example, batch_size=1, transport=TcpTransport(port=0, host=LOCALHOST))
    server.start()
    assert server.port is not None
    values = np.arange(n, dtype=np.float32) * 3
    with TcpClient(LOCALHOST, server.port, example) as client:
        client.send({"x": _strided(values, _LyingCopy)})
        client.wait(timeout=WAIT_S)
    got = server.sample(timeout=WAIT_S)
    assert got is not None
    np.testing.assert_array_equal(got.batch["x"][0], values)
    server.close()


# --- 2. start() racing close() ----------------------------------------------------------------


def test_start_racing_close_neither_deadlocks_nor_leaves_a_listener(
    run_python: Callable[..., Any],
) -> None:
    # In a child process: a deadlock holds the GIL, so it can only be caught from outside.
    code = textwrap.dedent(
        """
        import socket, threading
        import numpy as np
        from echo import Server, ServerClosedError, TcpTransport

        for attempt in range(40):
            server = Server({"x": np.zeros(2, np.float32)}, 4,
                            transport=TcpTransport(port=0, host="127.0.0.1", num_threads=64))
            outcome = {}
            def start():
                try:
                    server.start()
                    outcome["port"] = server.port
                except ServerClosedError:
                    outcome["port"] = None
            t = threading.Thread(target=start)
            t.start()
            server.close()
            t.join(20)
            assert not t.is_alive(), f"attempt {attempt}: start() hung"
            port = outcome["port"]
            if port is not None:  # start won: close() must still have stopped the listener
                s = socket.socket()
                s.settimeout(5)
                try:
                    s.connect(("127.0.0.1", port))
                    s.settimeout(2)
                    assert s.recv(64) == b"", f"attempt {attempt}: a live listener after close()"
                except (ConnectionRefusedError, ConnectionResetError):
                    pass
                finally:
                    s.close()
        print("ok")
        """
    )
    result = run_python(code, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# --- 6. no wait for a native lock with the GIL held ------------------------------------------


def _longest_gap_while(busy: Callable[[], None], during: Callable[[], None]) -> tuple[float, float]:
    """Runs `busy` in a thread; once it is under way, times `during` in this thread while a
    third thread ticks. Returns (how long `during` took, the ticker's longest gap meanwhile)."""
    stop = threading.Event()
    gaps: list[float] = []
    in_during = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            if in_during.is_set():
                gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick, daemon=True)
    worker = threading.Thread(target=busy, daemon=True)
    ticker.start()
    worker.start()
    time.sleep(0.05)  # let `busy` take the lock (its own call releases the GIL)
    in_during.set()
    started = time.perf_counter()
    during()
    took = time.perf_counter() - started
    in_during.clear()
    worker.join(WAIT_S * 6)
    stop.set()
    ticker.join(WAIT_S)
    return took, max(gaps, default=0.0)


@pytest.mark.parametrize("call", ["stats", "priority", "submit"])
def test_waiting_for_the_replay_lock_releases_the_gil(call: str) -> None:
    example = {"x": np.zeros((), np.float32)}
    server = Server(example, 1, sampler=echo.Prioritized(), max_size=64)
    for i in range(64):
        server.submit({"x": np.float32(i)})
    n = 8_000_000
    keys = np.arange(n, dtype=np.uint64) % 64
    priorities = np.ones(n, np.float64)

    def busy() -> None:
        server.update_priorities(keys, priorities)  # holds the table lock for a while

    calls: dict[str, Callable[[], object]] = {
        "stats": server.stats,
        "priority": lambda: server._core.priority(3),  # pyright: ignore[reportPrivateUsage]
        "submit": lambda: server.submit({"x": np.float32(1.0)}),
    }
    took, gap = _longest_gap_while(busy, lambda: calls[call]())
    server.close()
    if took < 0.1:
        pytest.skip(f"{call}() did not have to wait for the lock ({took:.3f} s)")
    # Holding the GIL while waiting freezes every other thread for the whole wait.
    assert gap < took / 2, f"{call}() waited {took:.3f} s; another thread stalled {gap:.3f} s"


# --- 8. absurd timeouts -----------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [1e30, float("inf"), sys.float_info.max])
def test_a_timeout_too_large_for_a_duration_means_no_limit(timeout: float) -> None:
    server = Server({"x": np.zeros((), np.float32)}, batch_size=1)
    server.submit({"x": np.float32(1.0)}, timeout=timeout)
    got = server.sample(timeout=timeout)
    assert got is not None
    assert float(got.batch["x"][0]) == 1.0
    server.close()


@pytest.mark.parametrize("timeout", [float("nan"), -1.0, -1e-9])
def test_a_nan_or_negative_timeout_is_a_value_error(timeout: float) -> None:
    server = Server({"x": np.zeros((), np.float32)}, batch_size=1)
    with pytest.raises(ValueError, match="timeout"):
        server.sample(timeout=timeout)
    with pytest.raises(ValueError, match="timeout"):
        server.submit({"x": np.float32(1.0)}, timeout=timeout)
    server.close()


def test_a_huge_connect_timeout_means_no_limit() -> None:
    example = {"x": np.zeros((), np.float32)}
    server = Server(example, 1, transport=TcpTransport(port=0, host=LOCALHOST))
    server.start()
    assert server.port is not None
    for timeout in (1e30, float("inf")):
        TcpClient(LOCALHOST, server.port, example, connect_timeout=timeout).close()
    with pytest.raises(ValueError, match="connect_timeout"):
        TcpClient(LOCALHOST, server.port, example, connect_timeout=float("nan"))
    server.close()


# --- 12. a peer that is not an echo server --------------------------------------------------


@pytest.fixture
def one_shot_server() -> Iterator[Callable[..., int]]:
    """`serve(chunks, delay=0)`: a plain socket on 127.0.0.1 that sends each chunk to the
    first connection (`delay` seconds apart), then closes it. Returns the port."""
    threads: list[threading.Thread] = []
    listeners: list[socket.socket] = []

    def serve(chunks: list[bytes], delay: float = 0.0) -> int:
        listener = socket.create_server((LOCALHOST, 0))
        listener.settimeout(WAIT_S)
        listeners.append(listener)

        def run() -> None:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                for chunk in chunks:
                    try:
                        conn.sendall(chunk)
                    except OSError:
                        return
                    time.sleep(delay)

        threads.append(threading.Thread(target=run, daemon=True))
        threads[-1].start()
        return int(listener.getsockname()[1])

    yield serve
    for thread in threads:
        thread.join(WAIT_S * 3)
    for listener in listeners:
        listener.close()


@pytest.mark.parametrize("reply", [b"NOPE", b"HTTP", b"EX", b"\x00"], ids=str)
def test_a_peer_that_sends_wrong_bytes_and_closes_is_not_an_echo_server(
    one_shot_server: Callable[..., int], reply: bytes
) -> None:
    port = one_shot_server([reply])
    with pytest.raises(ValueError, match="not an echo server"):
        TcpClient(LOCALHOST, port, {"x": np.zeros((), np.float32)})


def test_a_peer_that_closes_after_a_prefix_of_the_magic_is_a_closed_connection(
    one_shot_server: Callable[..., int],
) -> None:
    port = one_shot_server([b"EC"])
    with pytest.raises(ConnectionClosedError):
        TcpClient(LOCALHOST, port, {"x": np.zeros((), np.float32)})


# --- 7. connect_timeout bounds the whole connect -------------------------------------------


def test_connect_timeout_bounds_a_trickled_handshake(one_shot_server: Callable[..., int]) -> None:
    example = {"x": np.zeros((), np.float32)}
    server = Server(example, 1)  # only for the handshake bytes it would send
    handshake = b"ECHO\x01" + (1).to_bytes(4, "little") + (4).to_bytes(4, "little") + bytes(4)
    server.close()
    # One byte every 0.3 s: each read is quick, the whole handshake takes 6 s.
    port = one_shot_server([bytes([b]) for b in handshake], delay=0.3)
    with pytest.raises(TimeoutError, match="handshake"):
        TcpClient(LOCALHOST, port, example, connect_timeout=1.0)


def test_ctrl_c_interrupts_a_connect_waiting_for_the_handshake(
    run_python: Callable[..., Any],
) -> None:
    code = textwrap.dedent(
        """
        import os, signal, socket, threading, time
        import numpy as np
        from echo import TcpClient

        signal.signal(signal.SIGINT, signal.default_int_handler)  # if started with it ignored
        listener = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
        port = listener.getsockname()[1]
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        started = time.monotonic()
        try:
            TcpClient("127.0.0.1", port, {"x": np.zeros((), np.float32)}, connect_timeout=60)
        except KeyboardInterrupt:
            print(f"interrupted {time.monotonic() - started < 10}")
        """
    )
    result = run_python(code, timeout=60)
    assert result.stdout.strip() == "interrupted True", result.stderr


# --- 4. the ingress's memory is bounded in bytes -----------------------------------------------


def _recv_acks(sock: socket.socket, quiet: float) -> int:
    """Acks received until none arrives for `quiet` seconds."""
    got = 0
    sock.settimeout(quiet)
    while True:
        try:
            chunk = sock.recv(4096)
        except (TimeoutError, OSError):
            return got
        if not chunk:
            return got
        assert set(chunk) == {1}
        got += len(chunk)


def test_acknowledged_but_unsampled_bytes_stay_under_max_buffered_bytes() -> None:
    # 64 KiB samples; a learner that does not sample; peers that send 8 samples and close.
    # Without a bound, every closed connection's acknowledged samples stay in memory.
    example = {"id": np.zeros((), np.int64), "obs": np.zeros((16383,), np.float32)}
    payload = 8 + 4 * 16383
    limit = 6 * payload
    transport = TcpTransport(port=0, host=LOCALHOST, max_buffered_bytes=limit)
    server = Server(example, batch_size=1, num_buffers=2, transport=transport)
    server.start()
    assert server.port is not None
    # magic+version, count, two arrays, one dim; then the 38-byte offer of wire v2.
    handshake_len = 5 + 4 + 2 * 8 + 4 + 38
    acked: list[int] = []
    for peer in range(12):
        with socket.create_connection((LOCALHOST, server.port), timeout=WAIT_S) as sock:
            sock.settimeout(WAIT_S)
            got = b""
            while len(got) < handshake_len:
                got += sock.recv(handshake_len - len(got))
            sock.setblocking(False)
            for k in range(8):
                i = peer * 8 + k
                data = np.array(i, np.int64).tobytes() + np.full(16383, i, np.float32).tobytes()
                try:
                    sock.sendall(data)
                except (BlockingIOError, OSError):
                    break
            sock.setblocking(True)
            n = _recv_acks(sock, quiet=0.3)
            acked += [peer * 8 + k for k in range(n)]
        stats = server.stats()
        assert stats.buffered_bytes <= limit, stats
    # The ring holds 2 samples and the ingress at most `limit` bytes: nothing more was acked.
    assert len(acked) <= 2 + limit // payload, f"{len(acked)} samples acknowledged"
    # And nothing acknowledged is lost: the learner gets every one of them, exactly once.
    seen: list[int] = []
    while not set(acked) <= set(seen):  # unacknowledged ones may come in too, in any order
        got = server.sample(timeout=WAIT_S)
        assert got is not None
        ids = got.batch["id"].tolist()
        assert (got.batch["obs"] == got.batch["id"][:, None]).all()
        seen += ids
    assert len(seen) == len(set(seen))
    assert set(acked) <= set(seen)
    server.close()


def test_max_buffered_bytes_must_hold_one_sample() -> None:
    example = {"obs": np.zeros((1024,), np.float32)}
    transport = TcpTransport(port=0, host=LOCALHOST, max_buffered_bytes=100)
    server = Server(example, batch_size=1, transport=transport)
    with pytest.raises(ValueError, match=r"max_buffered_bytes \(100\) must hold at least one"):
        server.start()
    server.close()


# --- 5 and 9. idle connections cannot lock a worker out; refusals are logged in aggregate -----


def _silent_connections(port: int, n: int) -> list[socket.socket]:
    """`n` connections that read nothing and send nothing."""
    return [socket.create_connection((LOCALHOST, port), timeout=WAIT_S) for _ in range(n)]


def test_idle_connections_holding_every_slot_do_not_lock_a_worker_out() -> None:
    example = {"x": np.zeros((), np.float32)}
    transport = TcpTransport(port=0, host=LOCALHOST, max_connections=8)
    server = Server(example, batch_size=1, transport=transport)
    server.start()
    assert server.port is not None
    idle = _silent_connections(server.port, 8)
    try:
        deadline = time.monotonic() + WAIT_S
        while server.stats().active_connections < 8:
            assert time.monotonic() < deadline, "the idle connections were not all served"
            time.sleep(0.01)
        with TcpClient(LOCALHOST, server.port, example) as client:
            client.send({"x": np.float32(7.0)})
            client.wait(timeout=WAIT_S)
        got = server.sample(timeout=WAIT_S)
        assert got is not None
        assert got.batch["x"].tolist() == [7.0]
        assert server.stats().connections_evicted_total >= 1
    finally:
        for sock in idle:
            sock.close()
        server.close()


def test_working_connections_are_never_evicted_for_a_newcomer() -> None:
    example = {"x": np.zeros((), np.float32)}
    transport = TcpTransport(port=0, host=LOCALHOST, max_connections=2)
    server = Server(example, batch_size=1, num_buffers=8, transport=transport)
    server.start()
    assert server.port is not None
    workers = [TcpClient(LOCALHOST, server.port, example) for _ in range(2)]
    try:
        for i, worker in enumerate(workers):
            worker.send({"x": np.float32(i)})
            worker.wait(timeout=WAIT_S)
        with pytest.raises(ConnectionClosedError):
            TcpClient(LOCALHOST, server.port, example)
        for i, worker in enumerate(workers):  # both still work
            worker.send({"x": np.float32(10 + i)})
            worker.wait(timeout=WAIT_S)
        assert server.stats().connections_refused_total == 1
    finally:
        for worker in workers:
            worker.close()
        server.close()


def test_a_flood_of_refused_connections_is_logged_in_aggregate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    example = {"x": np.zeros((), np.float32)}
    transport = TcpTransport(port=0, host=LOCALHOST, max_connections=1)
    server = Server(example, batch_size=1, num_buffers=8, transport=transport)
    server.start()
    assert server.port is not None
    echo.reset_log_cache()
    with (
        caplog.at_level("DEBUG", logger="echo"),
        TcpClient(LOCALHOST, server.port, example) as worker,
    ):
        worker.send({"x": np.float32(1.0)})
        worker.wait(timeout=WAIT_S)
        for _ in range(50):
            with pytest.raises(ConnectionClosedError):
                TcpClient(LOCALHOST, server.port, example)
        assert server.stats().connections_refused_total == 50
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert 1 <= len(refusals) <= 2, [r.getMessage() for r in refusals]
    server.close()


# --- 10. close() and "nothing lost" -------------------------------------------------------------


def _acked_clients(port: int, example: Any, per_client: list[range]) -> None:
    """Sends each range's ids from its own client and waits until all are acknowledged.
    Over TCP, whose acknowledged samples may wait in the ingress's queues (over shared memory
    a sample is acknowledged only once it is in the ring)."""
    clients = [
        TcpClient(LOCALHOST, port, example, max_inflight_msgs=64, shared_memory=False)
        for _ in per_client
    ]
    for client, ids in zip(clients, per_client, strict=True):
        for i in ids:
            client.send({"id": np.array(i, np.int64), "x": np.full(3, i, np.float32)})
    for client in clients:
        client.wait(timeout=WAIT_S)
        client.close()


def _drain_server(batch_size: int) -> Server:
    example = {"id": np.zeros((), np.int64), "x": np.zeros(3, np.float32)}
    transport = TcpTransport(port=0, host=LOCALHOST)
    server = Server(example, batch_size, num_buffers=2, producer_queue_size=64, transport=transport)
    server.start()
    assert server.port is not None
    _acked_clients(server.port, example, [range(0, 21), range(100, 121)])  # 42 acknowledged
    return server


def test_close_with_drain_hands_out_every_acknowledged_full_batch() -> None:
    server = _drain_server(batch_size=4)
    deadline = time.monotonic() + WAIT_S
    while server.stats().samples_inserted_total < 8:  # the ring is full, the rest queued
        assert time.monotonic() < deadline
        time.sleep(0.01)
    server.close(drain=True)
    assert server.dropped_at_close is None  # still draining
    with pytest.raises(echo.ServerClosedError):
        server.submit({"id": np.array(-1, np.int64), "x": np.zeros(3, np.float32)})
    seen: list[int] = []
    for sample in server.dataset_iter():
        ids = sample.batch["id"].tolist()
        assert (sample.batch["x"] == sample.batch["id"][:, None]).all()
        seen += ids
    assert len(seen) == 40
    assert len(set(seen)) == 40
    assert server.dropped_at_close == 2  # 42 acknowledged: fewer than a batch left
    assert set(seen) <= set(range(0, 21)) | set(range(100, 121))
    for ids in (range(0, 21), range(100, 121)):  # per-client order
        mine = [i for i in seen if i in ids]
        assert mine == sorted(mine)


def test_a_plain_close_reports_the_acknowledged_samples_it_dropped() -> None:
    server = _drain_server(batch_size=4)
    deadline = time.monotonic() + WAIT_S
    while server.stats().samples_inserted_total < 8:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert server.stats().samples_pending == 34
    server.close()
    assert server.dropped_at_close == 42
    assert server.sample(timeout=WAIT_S) is None


def test_samples_inserted_total_counts_each_sample_when_it_goes_in() -> None:
    server = _drain_server(batch_size=4)  # one drainer round of ~40 blocks after 8
    deadline = time.monotonic() + WAIT_S
    while server.stats().store_size < 8:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    stats = server.stats()
    assert stats.samples_inserted_total == stats.store_size == 8, stats
    assert stats.samples_pending == 42 - 8
    server.close()


def test_a_server_sending_bytes_after_its_handshake_is_not_echo(
    one_shot_server: Callable[..., int],
) -> None:
    # Found by fuzzing: a debug build asserted here, a release build dropped the byte.
    handshake = b"ECHO\x01" + (1).to_bytes(4, "little") + (4).to_bytes(4, "little") + bytes(4)
    port = one_shot_server([handshake + b"\x01"])
    with pytest.raises(ValueError, match="after its handshake"):
        TcpClient(LOCALHOST, port, {"x": np.zeros((), np.float32)})


# --- careless sizes: an absurd setting is a ValueError, never a panic or an abort ----------------


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: Server({"x": np.zeros(2, np.float32)}, 2, producer_queue_size=2**62), "producer"),
        (lambda: Server({"x": np.zeros(2, np.float32)}, 2, num_drainers=2**62), "num_drainers"),
        (lambda: TcpTransport(0, num_threads=10**6), "num_threads"),
        (lambda: TcpTransport(0, max_connections=2**62), "max_connections"),
        (lambda: TcpTransport(0, max_buffered_bytes=2**70), "max_buffered_bytes"),
        (
            lambda: TcpClient(
                LOCALHOST, 1, {"x": np.zeros(2, np.float32)}, max_inflight_msgs=2**70
            ),
            "max_inflight_msgs",
        ),
    ],
    # The setting's name; not the lambda's repr, whose address differs between interpreters
    # (pytest-xdist's workers must collect the same test ids).
    ids=lambda v: v if isinstance(v, str) else "make",
)
def test_an_absurd_size_is_a_value_error(make: Callable[[], object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        make()
