"""Ragged samples from workers over TCP: every sample and group exactly once and whole,
refusals before anything is stored (layouts, tokens, wire v1, hostile headers), and the
server's errors and closing reaching the worker."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from testkit.net import (
    HELLO_CODECS,
    HELLO_NOTICES,
    HelloLeaf,
    ragged_dims,
    recv_exact,
    v2_handshake,
)

import echo
from echo import Packed, Ragged

MAX_LEN = 300


def example() -> dict[str, Any]:
    return {
        "tokens": Ragged(MAX_LEN, np.int32, group="completion"),
        "logp": Ragged(MAX_LEN, np.float32, group="completion"),
        "id": np.zeros((), np.int64),
    }


def length_of(i: int) -> int:
    return (i * 37) % (MAX_LEN + 1)


def make(i: int, n: int | None = None) -> dict[str, Any]:
    n = length_of(i) if n is None else n
    return {
        "tokens": (i * 1000 + np.arange(n)).astype(np.int32),
        "logp": -np.arange(n, dtype=np.float32),
        "id": np.int64(i),
    }


@pytest.fixture
def server() -> Iterator[echo.Server]:
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    with echo.Server(example(), 16, transport=transport, num_buffers=4) as s:
        yield s


SHM = pytest.mark.skipif(sys.platform != "linux", reason="shared memory needs Linux")


@pytest.mark.parametrize("path", ["tcp", pytest.param("shm", marks=SHM)])
def test_workers_deliver_every_sample_and_group_exactly_once(
    server: echo.Server, path: str
) -> None:
    assert server.port is not None
    port = server.port
    workers, groups = 4, 120

    def work(w: int) -> None:
        shm = path == "shm"
        with echo.TcpClient("127.0.0.1", port, example(), shared_memory=shm) as client:
            assert client.transport_path == path
            for g in range(groups):
                size = g % 4 + 1
                base = w * 100_000 + g * 4
                client.send_group([make(base + k) for k in range(size)], timeout=30)
            client.wait(30)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()

    def close_when_done() -> None:
        for t in threads:
            t.join()
        server.close(drain=True)

    closer = threading.Thread(target=close_when_done)
    closer.start()
    seen: set[int] = set()
    while (s := server.sample(timeout=30)) is not None:
        tokens = s.batch["tokens"]
        assert isinstance(tokens, Packed)
        ids = [int(i) for i in s.batch["id"]]
        assert s.keys is not None
        for k, i in enumerate(ids):
            a, b = int(tokens.cu_seqlens[k]), int(tokens.cu_seqlens[k + 1])
            np.testing.assert_array_equal(tokens.values[a:b], i * 1000 + np.arange(length_of(i)))
            if k and s.keys[k] == s.keys[k - 1]:
                assert i == ids[k - 1] + 1, "a group's samples side by side, in order"
            assert i not in seen, f"sample {i} twice"
            seen.add(i)
    closer.join()
    expected = {
        w * 100_000 + g * 4 + k
        for w in range(workers)
        for g in range(groups)
        for k in range(g % 4 + 1)
    }
    assert seen == expected


def test_bad_samples_raise_at_the_worker_and_nothing_is_sent(server: echo.Server) -> None:
    assert server.port is not None
    with echo.TcpClient("127.0.0.1", server.port, example()) as client:
        with pytest.raises(ValueError, match=r"\['logp'\]: 301 rows, more than its max_len 300"):
            client.send(make(1, 301))
        bad = make(2, 10)
        bad["logp"] = bad["logp"][:9]
        with pytest.raises(ValueError, match=r"has 9 rows but leaf \['tokens'\] has 10"):
            client.send(bad)
        with pytest.raises(
            ValueError, match=r"a group of 17 samples is larger than a batch \(batch_size 16\)"
        ):
            client.send_group([make(i, 1) for i in range(17)])
        assert client.sent == 0
        client.send(make(3, 4))
        client.wait(5)
    assert server.stats().store_size == 1


def test_a_sample_over_the_token_budget_is_refused_by_the_server() -> None:
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    with echo.Server(example(), 8, transport=transport, batch_tokens=100) as server:
        assert server.port is not None
        client = echo.TcpClient("127.0.0.1", server.port, example())
        client.send(make(1, 50))
        client.send(make(2, 101))
        with pytest.raises(ValueError, match=r"101 rows .*batch_tokens 100"):
            client.wait(5)
        client.close(timeout=0)
        assert server.stats().store_size == 1


def test_refusals_name_what_differs() -> None:
    transport = echo.TcpTransport(port=0, host="127.0.0.1", token="secret")
    with echo.Server(example(), 4, transport=transport) as server:
        port = server.port
        assert port is not None
        with pytest.raises(PermissionError):
            echo.TcpClient("127.0.0.1", port, example(), token="wrong")
        other = {**example(), "logp": Ragged(MAX_LEN, np.float64, group="completion")}
        with pytest.raises(
            ValueError, match=r"\['logp'\].*ragged leaves: \['logp'\], \['tokens'\]"
        ):
            echo.TcpClient("127.0.0.1", port, other, token="secret")
        fixed = {
            "tokens": np.zeros(4, np.int32),
            "logp": np.zeros(4, np.float32),
            "id": np.zeros((), np.int64),
        }
        with pytest.raises(ValueError, match="ragged leaves"):
            echo.TcpClient("127.0.0.1", port, fixed, token="secret", reconnect=False)
        with pytest.raises(ValueError, match="protocol=1 cannot carry ragged leaves"):
            echo.TcpClient("127.0.0.1", port, example(), protocol=1)
        longer = {
            **example(),
            "tokens": Ragged(2 * MAX_LEN, np.int32, group="completion"),
            "logp": Ragged(2 * MAX_LEN, np.float32, group="completion"),
        }
        with pytest.raises(
            ValueError,
            match=r"leaf \['logp'\]: the server expects float32 rows of shape \(\), 0 to 300 a "
            r"sample, in one length group with \['logp'\], \['tokens'\], the client has float32 "
            r"rows of shape \(\), 0 to 600 a sample",
        ):
            echo.TcpClient("127.0.0.1", port, longer, token="secret")
        ungrouped = {
            **example(),
            "tokens": Ragged(MAX_LEN, np.int32),
            "logp": Ragged(MAX_LEN, np.float32),
        }
        with pytest.raises(
            ValueError,
            match=r"leaf \['tokens'\]: .* in one length group with \['logp'\], \['tokens'\], "
            r"the client has .* alone in its length group",
        ):
            echo.TcpClient("127.0.0.1", port, ungrouped, token="secret")
        assert server.stats().handshakes_refused_layout_total >= 5


def _handshake(port: int, codecs: bool = False) -> socket.socket:
    """A raw connection that completes wire v2's handshake for `example()`, by hand (saying
    it sends compressed frames with `codecs`)."""
    leaves: list[HelloLeaf] = [
        ("['id']", b"<", b"i", 8, []),
        ("['logp']", b"<", b"f", 4, ragged_dims(MAX_LEN, 1)),
        ("['tokens']", b"<", b"i", 4, ragged_dims(MAX_LEN, 1)),  # logp's length group
    ]
    flags = HELLO_NOTICES | (HELLO_CODECS if codecs else 0)
    return v2_handshake(port, leaves, flags)


def test_a_hostile_header_gets_an_error_and_stores_nothing(server: echo.Server) -> None:
    assert server.port is not None
    sock = _handshake(server.port)
    # One sample claiming 4 billion rows: refused before any body is read or allocated.
    sock.sendall(bytes([0x18]) + struct.pack("<HII", 1, 0xFFFFFFFF, 0xFFFFFFFF))
    answer = b""
    while chunk := sock.recv(4096):
        answer += chunk
    assert answer[:1] == b"\x03"
    assert b"more than its max_len 300" in answer
    sock.close()
    # A valid frame by hand is stored and acknowledged.
    sock = _handshake(server.port)
    sample = make(7, 3)
    body = sample["id"].tobytes() + sample["logp"].tobytes() + sample["tokens"].tobytes()
    sock.sendall(bytes([0x18]) + struct.pack("<HII", 1, 3, 3) + body)
    assert sock.recv(1) == b"\x01"
    sock.close()
    assert server.stats().store_size == 1


def test_workers_hear_that_the_server_closed() -> None:
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    server = echo.Server(example(), 4, transport=transport)
    server.start()
    assert server.port is not None
    client = echo.TcpClient("127.0.0.1", server.port, example())
    client.send(make(1, 2))
    client.wait(5)
    server.close()

    def keep_sending() -> None:
        for i in range(1000):  # the notice arrives while the worker goes on
            client.send(make(i, 2), timeout=5)
            client.wait(5)

    with pytest.raises(echo.ServerClosedError):
        keep_sending()
    assert client.server_closing == "final"
    client.close(timeout=0)


@SHM
def test_shared_memory_required_from_a_server_without_it_raises_naming_why() -> None:
    transport = echo.TcpTransport(port=0, host="127.0.0.1", shared_memory=False)
    with echo.Server(example(), 4, transport=transport) as server:
        assert server.port is not None
        with pytest.raises(echo.SharedMemoryError, match=r"shared memory turned off"):
            echo.TcpClient("127.0.0.1", server.port, example(), shared_memory=True)
        with echo.TcpClient("127.0.0.1", server.port, example()) as client:
            assert client.transport_path == "tcp"
            client.send(make(1))
            client.wait(5)
        assert server.stats().store_size == 1


_KILLED_WORKER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import echo
    from echo import Ragged

    port = int(sys.argv[1])
    example = {
        "tokens": Ragged(300, np.int32, group="completion"),
        "logp": Ragged(300, np.float32, group="completion"),
        "id": np.zeros((), np.int64),
    }
    client = echo.TcpClient("127.0.0.1", port, example, shared_memory=True)
    assert client.transport_path == "shm"
    for i in range(1_000_000):
        n = (i * 37) % 301
        client.send_group(
            [
                {
                    "tokens": (i * 1000 + np.arange(n)).astype(np.int32),
                    "logp": -np.arange(n, dtype=np.float32),
                    "id": np.int64(i),
                }
            ],
            timeout=60,
        )
        if i == 50:
            client.wait(30)
            print("acked", flush=True)
    """
)


@SHM
def test_a_worker_killed_while_writing_its_pipe_loses_only_unacknowledged_samples() -> None:
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    with echo.Server(example(), 8, transport=transport, num_buffers=64) as server:
        assert server.port is not None
        worker = subprocess.Popen(
            [sys.executable, "-c", _KILLED_WORKER, str(server.port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert worker.stdout is not None
            assert worker.stdout.readline().strip() == "acked"
            # Killed while it writes frames into its pipe (the learner is not reading its
            # batches, so the table and then the pipe fill): the pipe ends part-way.
            time.sleep(0.2)
            os.kill(worker.pid, signal.SIGKILL)
        finally:
            worker.kill()  # ends only the process this test started, by its PID
            worker.wait(30)
            if worker.stdout is not None:
                worker.stdout.close()
        seen: list[int] = []

        def take(s: echo.Sample) -> None:
            tokens = s.batch["tokens"]
            assert isinstance(tokens, Packed)
            for k, i in enumerate(int(i) for i in s.batch["id"]):
                a, b = int(tokens.cu_seqlens[k]), int(tokens.cu_seqlens[k + 1])
                want = i * 1000 + np.arange(length_of(i))
                np.testing.assert_array_equal(tokens.values[a:b], want)
                seen.append(i)

        # The learner reads until no full batch comes: the pipe is read to its end meanwhile.
        for _ in range(100_000):
            try:
                s = server.sample(timeout=2)
            except TimeoutError:
                break
            assert s is not None
            take(s)
        # The server serves the next worker.
        with echo.TcpClient("127.0.0.1", server.port, example(), shared_memory=True) as client:
            client.send(make(10**6))
            client.wait(5)
        server.close(drain=True)
        while (s := server.sample(timeout=5)) is not None:
            take(s)
        # Every acknowledged sample is there, once and whole; nothing after a gap; and the
        # worker after it.
        assert seen[-1] == 10**6
        assert seen[:-1] == list(range(len(seen) - 1))
        assert len(seen) - 1 >= 51


class _CuttingProxy:
    """A TCP proxy on loopback to `port` that cuts each of its first `cuts` connections
    after `after` bytes from the worker (mid-frame, mostly), then forwards whole."""

    def __init__(self, port: int, cuts: int, after: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cut = 0
        self._target, self._cuts, self._after = port, cuts, after
        self._socks: list[socket.socket] = []
        self._closed = False
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        self.listener.settimeout(0.1)
        for _ in range(10_000):
            if self._closed:
                return
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            server = socket.create_connection(("127.0.0.1", self._target))
            self._socks += [client, server]
            limit = self._after if self.cut < self._cuts else 1 << 62
            for args in ((client, server, limit), (server, client, 1 << 62)):
                t = threading.Thread(target=self._pipe, args=args, daemon=True)
                t.start()
                self._threads.append(t)

    def _pipe(self, src: socket.socket, dst: socket.socket, limit: int) -> None:
        passed = 0
        try:
            while passed < limit and (data := src.recv(65536)):
                data = data[: limit - passed]
                dst.sendall(data)
                passed += len(data)
            if passed >= limit:
                self.cut += 1
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut_now(self) -> None:
        """Cuts every connection open now (a network blip); later ones go through."""
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self._threads[0].join(timeout=10)
        self.listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(timeout=10)
        for s in self._socks:
            s.close()


def test_a_worker_that_reconnects_after_cut_connections_stores_each_sample_once(
    server: echo.Server,
) -> None:
    assert server.port is not None
    proxy = _CuttingProxy(server.port, cuts=3, after=50_000)
    n = 300
    ids: list[int] = []
    try:
        with echo.TcpClient(
            "127.0.0.1", proxy.port, example(), shared_memory=False, reconnect=True,
            reconnect_timeout=30,
        ) as client:  # fmt: skip
            for i in range(n):
                client.send(make(i), timeout=30)
                if i % 16 == 15:  # the learner's turn: 16 a batch
                    # A lost connection is noticed, and the unstored frames resent, by the
                    # worker's next call: here the wait() (the learner shares its thread).
                    client.wait(30)
                    s = server.sample(timeout=30)
                    assert s is not None
                    ids.extend(int(j) for j in s.batch["id"])
            client.wait(30)
            assert client.reconnects >= 1
            assert client.acked == client.sent == n
            resumed = client.resumed_from
            assert resumed is not None
            assert 0 < resumed <= n
            assert client.server_closing is None  # cut connections, not a closing server
            assert client.retained_bytes == 0  # everything is stored
            assert server.stats().sessions_resumed_total == client.reconnects
    finally:
        proxy.close()
    server.close(drain=True)
    while (s := server.sample(timeout=5)) is not None:
        ids.extend(int(j) for j in s.batch["id"])
    assert proxy.cut == 3
    assert sorted(ids) == list(range(n)), "every sample once"


def test_a_restored_server_keeps_its_workers_sessions_and_they_go_on_exactly_once(
    tmp_path: Any,
) -> None:
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    first = echo.Server(example(), 8, transport=transport, sampler=echo.Uniform(), max_size=500)
    first.start()
    port = first.port
    assert port is not None
    client = echo.TcpClient(
        "127.0.0.1", port, example(), shared_memory=False, reconnect=True, reconnect_timeout=30
    )
    for i in range(40):
        client.send(make(i), timeout=30)
    client.wait(30)
    assert (client.resumed_from, client.server_closing, client.retained_bytes) == (None, None, 0)
    first.checkpoint(tmp_path / "ckpt")
    manifest = (tmp_path / "ckpt" / "ragged.json").read_text()
    assert '"sessions": 1' in manifest
    first.close(restarting=True)
    again = echo.TcpTransport(port=port, host="127.0.0.1")
    second = echo.Server.restore(tmp_path / "ckpt", example(), transport=again)
    second.start()
    try:
        for i in range(40, 80):
            client.send(make(i), timeout=30)
        client.wait(30)
        assert client.reconnects >= 1
        assert client.server_closing == "restarting"
        assert client.resumed_from == 40  # what the checkpoint held
        client.close()
        stats = second.stats()
        assert stats.store_size == 80
        seen: list[int] = []
        for _ in range(200):  # uniform draws until every id was seen
            s = second.sample(timeout=5)
            assert s is not None
            seen.extend(int(i) for i in s.batch["id"])
            if len(set(seen)) == 80:
                break
        assert set(seen) == set(range(80))
    finally:
        second.close()


@pytest.mark.parametrize("path", ["tcp", pytest.param("shm", marks=SHM)])
def test_a_checkpoint_of_a_full_table_waits_for_none_of_the_blocked_workers(
    tmp_path: Any, path: str
) -> None:
    """24 workers' frames wait for room in a full FIFO table (each connection looks again
    every 100 ms). A checkpoint then copies the table and counts every session without
    waiting for any of them (it used to take each one's insert slice in turn, a second or
    more here), and every sample still arrives once after it."""
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    with echo.Server(example(), 1, transport=transport, num_buffers=8) as server:
        assert server.port is not None
        workers = [
            echo.TcpClient("127.0.0.1", server.port, example(), shared_memory=path == "shm")
            for _ in range(32)
        ]
        assert {w.transport_path for w in workers} == {path}
        for i, worker in enumerate(workers):
            worker.send(make(i), timeout=10)
        deadline = time.monotonic() + 10
        while server.stats().store_size < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # the other 24 are blocked in their inserts
        assert server.stats().store_size == 8
        started = time.monotonic()
        server.checkpoint(tmp_path / "ckpt")
        took = time.monotonic() - started
        assert took < 0.5, f"the checkpoint waited {took:.2f} s for blocked workers"
        ids: list[int] = []
        while len(ids) < 32:
            batch = server.sample(timeout=10)
            assert batch is not None
            ids += [int(i) for i in batch.batch["id"]]
        assert sorted(ids) == list(range(32))
        for worker in workers:
            worker.close()
    with echo.Server.restore(tmp_path / "ckpt") as restored:
        assert restored.stats().store_size == 8


def test_a_worker_that_cannot_reconnect_in_time_says_so_and_sends_no_more(
    server: echo.Server,
) -> None:
    assert server.port is not None
    proxy = _CuttingProxy(server.port, cuts=1, after=20_000)
    client = echo.TcpClient(
        "127.0.0.1", proxy.port, example(), shared_memory=False, reconnect=True,
        reconnect_timeout=0.5,
    )  # fmt: skip
    proxy.close()  # its connection is cut, and no other is accepted

    def send_all() -> None:
        for i in range(1000):
            client.send(make(i, 300), timeout=10)
        client.wait(10)

    with pytest.raises(ConnectionError, match=r"could not reconnect within"):
        send_all()
    with pytest.raises(ConnectionError, match=r"could not be re-established"):
        client.send(make(1000, 3), timeout=10)
    assert client.reconnects == 0
    client.close(timeout=0)


def test_a_reconnecting_worker_keeps_to_the_timeout_of_the_call(server: echo.Server) -> None:
    assert server.port is not None
    proxy = _CuttingProxy(server.port, cuts=0, after=0)
    client = echo.TcpClient(
        "127.0.0.1", proxy.port, example(), shared_memory=False, reconnect=True,
        reconnect_timeout=60,
    )  # fmt: skip
    client.send(make(1), timeout=10)
    client.wait(10)
    proxy.close()  # the connection is gone, and no other is accepted
    started = time.monotonic()
    with contextlib.suppress(TimeoutError):  # refused in the wait, or handed over to resend
        client.send(make(2), timeout=0.5)
    client.close(timeout=0.5)
    assert time.monotonic() - started < 10, "the calls kept to their timeouts, not 60 s"
    assert client.given_up == client.sent - client.acked


def test_every_client_property_answers_for_a_ragged_worker(server: echo.Server) -> None:
    """A ragged worker is a `TcpClient`: each of its properties answers (none reaches for a
    fixed-shape sender it does not have)."""
    assert server.port is not None
    with echo.TcpClient("127.0.0.1", server.port, example(), shared_memory=False) as client:
        client.send(make(3))
        client.wait(10)
        names = [
            name
            for name, attr in vars(echo.TcpClient).items()
            if isinstance(attr, property) and not name.startswith("_")
        ]
        values = {name: getattr(client, name) for name in names}
        assert values["sent"] == values["acked"] == 1
        assert values["protocol"] == 2
        assert values["transport_path"] == "tcp"
        assert values["wire_compression_leaves"] == {}
        assert values["given_up"] is None
        quiet = ("params_version", "params_fetches", "policy_version", "admission_waits")
        assert all(values[name] == 0 for name in quiet)
        assert (values["keeps_versions"], values["durable"]) == (False, False)
        assert (values["sequence_rows"], values["server_closing"]) == (None, None)
        client.wait_persisted(10)  # not durable: as wait()
        with pytest.raises(TimeoutError):
            client.params(timeout=0.1)  # nothing published
        client.policy_version = 5  # kept for a server that keeps versions (this one does not)
        assert client.policy_version == 5
    assert client.given_up == 0


@pytest.mark.parametrize("shm", [False, pytest.param(True, marks=SHM)])
def test_a_priority_for_a_fifo_table_or_an_empty_group_is_refused_by_the_worker_which_goes_on(
    server: echo.Server, shm: bool
) -> None:
    assert server.port is not None
    client = echo.TcpClient("127.0.0.1", server.port, example(), shared_memory=shm)
    with pytest.raises(ValueError, match=r"FIFO: it takes no priorities"):
        client.send(make(0), priority=1.0, timeout=10)
    with pytest.raises(ValueError, match=r"FIFO: it takes no priorities"):
        client.send_group([make(1), make(2)], priority=1.0, timeout=10)
    with pytest.raises(ValueError, match=r"a group needs at least one sample, got none"):
        client.send_group([], timeout=10)  # as in-process
    for i in range(16):  # nothing was sent: the connection serves on
        client.send(make(i), timeout=10)
    client.wait(10)
    s = server.sample(timeout=10)
    assert s is not None
    assert sorted(s.batch["id"].tolist()) == list(range(16))
    client.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_reconnecting_worker_started_before_its_learner_waits_for_it() -> None:
    port = _free_port()
    with pytest.raises(ConnectionRefusedError):
        echo.TcpClient("127.0.0.1", port, example())  # no reconnect: at once
    with pytest.raises(TimeoutError, match=rf"could not connect to 127.0.0.1:{port} within"):
        echo.TcpClient(
            "127.0.0.1", port, example(), reconnect=True, reconnect_timeout=0.5,
            connect_timeout=0.5,
        )  # fmt: skip
    made: list[echo.Server] = []

    def learner() -> None:
        made.append(
            echo.Server(example(), 4, transport=echo.TcpTransport(port=port, host="127.0.0.1"))
        )
        made[0].start()

    later = threading.Timer(0.5, learner)
    later.start()
    try:
        client = echo.TcpClient(
            "127.0.0.1", port, example(), reconnect=True, reconnect_timeout=20,
            shared_memory=False,
        )  # fmt: skip
        later.join()
        for i in range(4):
            client.send(make(i), timeout=10)
        s = made[0].sample(timeout=10)
        assert s is not None
        assert sorted(s.batch["id"].tolist()) == [0, 1, 2, 3]
        client.close()
    finally:
        later.join()
        for server in made:
            server.close()


def _no_hello(port: int) -> socket.socket:
    """A peer that connects, reads the offer and never says hello."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    assert recv_exact(sock, 38)[:5] == b"ECHO\x02"
    return sock


@pytest.mark.parametrize("stage", ["past the handshake", "in the handshake"])
def test_silent_peers_are_evicted_for_a_worker_and_working_ones_never(stage: str) -> None:
    transport = echo.TcpTransport(port=0, host="127.0.0.1", max_connections=2)
    with echo.Server(example(), 4, transport=transport) as server:
        port = server.port
        assert port is not None
        peer = _handshake if stage == "past the handshake" else _no_hello
        silent = [peer(port), peer(port)]  # every slot, and then nothing
        time.sleep(0.1)
        worker = echo.TcpClient("127.0.0.1", port, example(), shared_memory=False)
        for i in range(4):
            worker.send(make(i), timeout=10)
        worker.wait(10)
        s = server.sample(timeout=10)
        assert s is not None
        assert sorted(s.batch["id"].tolist()) == [0, 1, 2, 3]
        assert server.stats().connections_evicted_total == 1
        silent[0].settimeout(5)
        assert silent[0].recv(1) == b"", "the oldest silent peer was closed"
        other = echo.TcpClient("127.0.0.1", port, example(), shared_memory=False)
        other.send(make(4), timeout=10)
        other.wait(10)  # evicted the second silent peer; now both slots work
        with pytest.raises(
            ConnectionRefusedError,
            match=r"refused the connection: the server serves no more connections: all 2 are "
            r"working ones",
        ):
            echo.TcpClient("127.0.0.1", port, example(), shared_memory=False)
        assert server.stats().connections_evicted_total == 2
        worker.close()
        other.close()
        for sock in silent:
            sock.close()


def test_a_peer_silent_in_the_middle_of_a_frame_gives_its_bytes_back_and_an_idle_one_stays() -> (
    None
):
    """A frame's body holds its bytes in the ingress's budget: a peer that stops in the
    middle of one (a vanished host, a hostile peer) is dropped after the transport's
    heartbeat_timeout without a byte, with an error saying so, and the worker that waited
    for room is served. A peer idle between frames stays connected however long."""
    transport = echo.TcpTransport(
        port=0, host="127.0.0.1", heartbeat_timeout=0.5, max_buffered_bytes=1000
    )
    with echo.Server(example(), 4, transport=transport) as server:
        port = server.port
        assert port is not None
        idle = _handshake(port)
        stalled = _handshake(port)
        # One sample of 100 rows: id (8 bytes), logp and tokens (400 bytes each).
        header = bytes([0x18]) + struct.pack("<HII", 1, 100, 100)
        stalled.sendall(header + bytes(10))  # 10 of its 808 body bytes, then nothing
        time.sleep(0.1)
        worker = echo.TcpClient("127.0.0.1", port, example(), shared_memory=False)
        started = time.monotonic()
        for i in range(4):
            worker.send(make(i, 37), timeout=10)  # waits for the budget the peer holds
        worker.wait(10)
        s = server.sample(timeout=10)
        assert s is not None
        assert sorted(s.batch["id"].tolist()) == [0, 1, 2, 3]
        assert time.monotonic() - started < 5
        stalled.settimeout(5)
        told = b""
        while chunk := stalled.recv(4096):
            told += chunk
        assert b"no byte of a frame's body for 500" in told
        idle.settimeout(1.0)
        with pytest.raises(TimeoutError):
            idle.recv(1)  # still open: nothing to say, nothing said
        worker.close()
        idle.close()
        stalled.close()


def test_a_raw_frame_with_a_priority_for_a_fifo_table_is_told_why(server: echo.Server) -> None:
    assert server.port is not None
    sock = _handshake(server.port)
    body = struct.pack("<q", 7) + bytes(4 * 2 * 3)  # id, then 3 rows of logp and of tokens
    sock.sendall(bytes([0x19]) + struct.pack("<Hd", 1, 1.0) + struct.pack("<II", 3, 3) + body)
    sock.settimeout(5)
    told = b""
    while chunk := sock.recv(4096):
        told += chunk
    assert told[:1] == b"\x03"
    assert b"a FIFO table takes no priorities" in told
    assert server.stats().store_size == 0
    sock.close()


def test_a_worker_held_back_by_a_full_table_says_so_when_it_times_out() -> None:
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    with echo.Server(example(), 1, transport=transport, num_buffers=2) as server:
        assert server.port is not None
        worker = echo.TcpClient("127.0.0.1", server.port, example(), shared_memory=False)
        for i in range(6):
            worker.send(make(i, 5), timeout=10)
        with pytest.raises(TimeoutError, match=r"waiting for the learner's acknowledgements"):
            worker.wait(0.3)
        ids = []
        for _ in range(6):  # the learner takes them: every one arrives
            s = server.sample(timeout=10)
            assert s is not None
            ids += s.batch["id"].tolist()
        assert sorted(ids) == list(range(6))
        worker.wait(10)
        worker.close()
