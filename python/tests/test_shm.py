"""The same-host shared-memory path of `TcpClient` (`shared_memory=`): exactly once and in
per-worker order from worker processes, a worker killed half-way through a sample, the
learner closing under writing workers, forced-TCP workers mixed in, the precise error when
shared memory is required and cannot be had, and nothing left behind after `close()`.

The workers are forked from one helper interpreter (`_shm_worker.py`) that reports what each
one did, one line per event.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import WAIT_S, assert_ctrl_c_interrupts_promptly, poll, read_line

from echo import ConnectionClosedError, Server, SharedMemoryError, TcpClient, TcpTransport

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="shared memory is Linux-only")

HERE = Path(__file__).resolve().parent
FLEET = HERE / "_shm_worker.py"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from _shm_worker import EXAMPLE, ID_STRIDE  # noqa: E402

LOCALHOST = "127.0.0.1"


def _sample(v: int) -> dict[str, np.ndarray]:
    return {"id": np.array(v, np.int64), "obs": np.full((3,), v, np.float32)}


def _server(make_server: Any, batch_size: int = 4, **transport: Any) -> Server:
    server = make_server(
        EXAMPLE,
        batch_size=batch_size,
        transport=TcpTransport(port=0, host=LOCALHOST, **transport),
    )
    server.start()
    return server


def _started(make_server: Any, **kwargs: Any) -> Server:
    """A started server of `EXAMPLE` samples on 127.0.0.1 with the `Server` keyword arguments
    `kwargs`."""
    server = make_server(EXAMPLE, transport=TcpTransport(port=0, host=LOCALHOST), **kwargs)
    server.start()
    return server


def _shm_fds() -> tuple[int, int]:
    """This process's memfd segments and eventfds."""
    memfds = eventfds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        memfds += target.startswith("/memfd:echo-shm")
        eventfds += target == "anon_inode:[eventfd]"
    return memfds, eventfds


def _dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


class Fleet:
    """Worker processes forked by one `_shm_worker.py`, and what they reported."""

    def __init__(self, port: int, first: int, num: int, count: int, shm: str, *stop: int):
        env = {**os.environ, "PYTHONFAULTHANDLER": "1", "OPENBLAS_NUM_THREADS": "1"}
        args = [str(a) for a in (port, first, num, count, shm, *stop)]
        self.proc = subprocess.Popen(
            [sys.executable, str(FLEET), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: list[list[str]] = []
        self.pids: dict[int, int] = {}

    def read_until(self, kind: str, worker: int, timeout: float = 2 * WAIT_S) -> list[str]:
        """Reads lines until worker `worker` reported `kind`; returns that line."""
        deadline = time.monotonic() + timeout
        for line in self.lines:
            if line[0] == kind and int(line[1]) == worker:
                return line
        for _ in range(100_000):
            left = deadline - time.monotonic()
            assert left > 0, f"no {kind!r} from worker {worker}; got {self.lines}"
            raw = read_line(self.proc, left)
            assert raw, f"the fleet ended before {kind!r} from worker {worker}: {self.finish()}"
            line = raw.split(maxsplit=5)
            self.lines.append(line)
            if line[0] == "pid":
                self.pids[int(line[1])] = int(line[2])
            if line[0] == kind and int(line[1]) == worker:
                return line
        raise AssertionError("unreachable")

    def finish(self, timeout: float = 2 * WAIT_S) -> str:
        """Waits for the fleet (killing it if it overruns); returns its stderr."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.proc.communicate()
        self.lines += [line.split(maxsplit=5) for line in out.splitlines()]
        for line in self.lines:
            if line[0] == "pid":
                self.pids[int(line[1])] = int(line[2])
        return err

    def kill(self) -> None:
        for pid in self.pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()

    def reports(self, kind: str) -> dict[int, list[str]]:
        return {int(line[1]): line for line in self.lines if line[0] == kind}


def _receive(server: Server, n: int) -> dict[int, list[int]]:
    """The next `n` samples by worker, in arrival order (checks every slot is whole)."""
    per_worker: dict[int, list[int]] = collections.defaultdict(list)
    got = 0
    for _ in range(n):
        if got >= n:
            break
        sample = server.sample(timeout=2 * WAIT_S)
        assert sample is not None
        ids = np.asarray(sample.batch["id"])
        np.testing.assert_array_equal(
            np.asarray(sample.batch["obs"]), np.repeat(ids.astype(np.float32)[:, None], 3, 1)
        )
        for v in ids.tolist():
            per_worker[v // ID_STRIDE].append(v % ID_STRIDE)
        got += len(ids)
    assert got == n
    return per_worker


@pytest.mark.parametrize(("num_workers", "per_worker"), [(1, 400), (8, 100), (64, 8)])
def test_every_sample_arrives_once_and_in_order_over_shared_memory(
    make_server: Any, num_workers: int, per_worker: int
) -> None:
    server = _server(make_server, batch_size=8)
    shm_before = _dev_shm()
    baseline = _shm_fds()
    fleet = Fleet(server.port, 0, num_workers, per_worker, "true")
    try:
        received = _receive(server, num_workers * per_worker)
        err = fleet.finish()
        assert err == "", err
        assert sorted(received) == list(range(num_workers))
        for w, seqs in received.items():
            assert seqs == list(range(per_worker)), f"worker {w}: {seqs}"
        paths = fleet.reports("path")
        assert {line[2] for line in paths.values()} == {"shm"}, paths
        closed = fleet.reports("closed")
        assert sorted(closed) == list(range(num_workers)), fleet.lines
        for w, line in closed.items():
            flushed, opened, left = line[2], int(line[3]), int(line[4])
            assert flushed == "True", line
            assert opened >= 3, f"worker {w} held no segment and bells while connected: {line}"
            assert left == 0, f"worker {w} kept {left} shared-memory descriptors: {line}"
        with pytest.raises(TimeoutError):
            server.sample(timeout=0.05)  # nothing more than what was sent
        info = poll(server.stats, lambda s: s.active_connections == 0, "workers gone")
        assert info.shm_connections_total == num_workers
        assert info.shm_fallbacks_total == 0
        assert info.samples_inserted_total == num_workers * per_worker
        # The learner closed every segment and bell with its connection.
        assert _shm_fds() == baseline
        assert _dev_shm() == shm_before
    finally:
        fleet.kill()
        fleet.finish()


@pytest.mark.parametrize(("num_workers", "per_worker"), [(1, 400), (8, 100), (64, 8)])
def test_samples_inserted_total_never_lags_a_batch_over_shared_memory(
    make_server: Any, num_workers: int, per_worker: int
) -> None:
    """On every batch, `samples_inserted_total` covers every sample the learner could have
    seen: the batches handed out so far (this one included) and what is committed behind them
    (`store_size`). The shared-memory path must count each sample before the commit that can
    wake `sample()`, as the TCP drainers do; counting after the insert returned let a batch
    report fewer inserted samples than it held."""
    batch_size = 2
    server = _server(make_server, batch_size=batch_size)
    fleet = Fleet(server.port, 0, num_workers, per_worker, "true")
    total = num_workers * per_worker
    lags: list[tuple[int, int, int]] = []
    try:
        for _ in range(total // batch_size):
            sample = server.sample(timeout=2 * WAIT_S)
            assert sample is not None
            info = sample.info
            seen = (info.sequence + 1) * batch_size + info.store_size
            if info.samples_inserted_total < seen:
                lags.append((info.sequence, info.samples_inserted_total, seen))
        assert fleet.finish() == ""
        assert {line[2] for line in fleet.reports("path").values()} == {"shm"}
        assert lags == [], f"(batch, inserted, handed out + committed): {lags[:10]}"
        assert server.stats().samples_inserted_total == total
    finally:
        fleet.kill()
        fleet.finish()


def test_forced_tcp_workers_mix_with_shared_memory_ones(make_server: Any) -> None:
    server = _server(make_server, batch_size=10)
    shm_fleet = Fleet(server.port, 0, 4, 50, "auto")
    tcp_fleet = Fleet(server.port, 4, 2, 50, "false")
    try:
        received = _receive(server, 6 * 50)
        for fleet in (shm_fleet, tcp_fleet):
            assert fleet.finish() == ""
        assert {w: seqs == list(range(50)) for w, seqs in received.items()} == {
            w: True for w in range(6)
        }
        paths = {**shm_fleet.reports("path"), **tcp_fleet.reports("path")}
        assert {w: line[2] for w, line in paths.items()} == {
            0: "shm",
            1: "shm",
            2: "shm",
            3: "shm",
            4: "tcp",
            5: "tcp",
        }
        info = poll(server.stats, lambda s: s.active_connections == 0, "workers gone")
        assert (info.shm_connections_total, info.v2_connections_total) == (4, 6)
    finally:
        for fleet in (shm_fleet, tcp_fleet):
            fleet.kill()
            fleet.finish()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_worker_killed_in_the_middle_of_a_sample_leaves_nothing_behind(
    make_server: Any,
) -> None:
    server = _server(make_server, batch_size=1)
    baseline = _shm_fds()
    # Worker 0 stops itself half-way through writing its sample 5 (before committing it).
    fleet = Fleet(server.port, 0, 1, 10, "true", 0, 5)
    try:
        assert fleet.read_until("path", 0)[2] == "shm"
        pid = fleet.pids[0]
        poll(lambda: _stopped(pid), bool, "worker stopped mid-sample")
        os.kill(pid, signal.SIGKILL)
        assert fleet.finish() == ""
        # Samples 0-4 arrive, whole and in order; the half-written sample 5 never does.
        assert _receive(server, 5) == {0: [0, 1, 2, 3, 4]}
        info = poll(server.stats, lambda s: s.active_connections == 0, "killed worker gone")
        with pytest.raises(TimeoutError):
            server.sample(timeout=0.2)
        assert info.samples_inserted_total == 5
        # The learner dropped the worker's segment and bells.
        assert _shm_fds() == baseline
        # And it keeps serving.
        with TcpClient(LOCALHOST, server.port, EXAMPLE, shared_memory=True) as client:
            for i in range(3):
                client.send(_sample(7 * ID_STRIDE + i))
        assert _receive(server, 3) == {7: [0, 1, 2]}
    finally:
        fleet.kill()
        fleet.finish()


def test_the_learner_closing_while_workers_write_raises_connection_closed(
    make_server: Any,
) -> None:
    server = _server(make_server, batch_size=4)
    fleet = Fleet(server.port, 0, 4, 0, "true")  # send until the connection fails
    try:
        for w in range(4):
            assert fleet.read_until("path", w)[2] == "shm"
        for _ in range(10):
            assert server.sample(timeout=2 * WAIT_S) is not None
        server.close()
        for w in range(4):
            line = fleet.read_until("error", w)
            assert line[2] == "ConnectionClosedError", line
        assert fleet.finish() == ""
    finally:
        fleet.kill()
        fleet.finish()


def test_a_learner_gone_while_a_send_waits_for_room_raises_connection_closed(
    make_server: Any,
) -> None:
    server = _started(
        make_server,
        batch_size=1,
        num_buffers=2,
        producer_queue_size=1,
    )
    client = TcpClient(LOCALHOST, server.port, EXAMPLE, shared_memory=True, max_inflight_msgs=4)
    try:
        # Nobody samples: the ring, the ingress and then the window fill.
        sent = 0
        for i in range(1000):
            try:
                client.send(_sample(i), timeout=0.5)
            except TimeoutError:
                break
            sent += 1
        assert 0 < sent < 1000
        server.close()
        with pytest.raises(ConnectionClosedError):
            client.send(_sample(0), timeout=WAIT_S)
    finally:
        client.close(timeout=1.0)


class V1OnlyServer:
    """A plain-socket server that greets like id-echo 0.2.1 (the v1 handshake alone)."""

    def __init__(self) -> None:
        self._listener = socket.create_server((LOCALHOST, 0))
        self._listener.settimeout(WAIT_S)
        self.port: int = self._listener.getsockname()[1]

    def serve_one(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            conn.sendall(
                b"ECHO\x01"
                + (2).to_bytes(4, "little")
                + b"".join(w.to_bytes(4, "little") for w in (8, 0))
                + b"".join(w.to_bytes(4, "little") for w in (4, 1, 3))
            )
            conn.settimeout(WAIT_S)
            conn.recv(1)

    def close(self) -> None:
        self._listener.close()


def test_shared_memory_true_says_precisely_why_it_cannot_be_had(make_server: Any) -> None:
    server = _server(make_server, shared_memory=False)
    with pytest.raises(SharedMemoryError, match=r"shared memory turned off"):
        TcpClient(LOCALHOST, server.port, EXAMPLE, shared_memory=True)
    info = poll(server.stats, lambda s: s.active_connections == 0, "refused client gone")
    assert info.shm_fallbacks_total == 1
    # The same server serves `None` over TCP, silently.
    with TcpClient(LOCALHOST, server.port, EXAMPLE) as client:
        assert client.transport_path == "tcp"
    with pytest.raises(SharedMemoryError, match=r"needs wire protocol 2"):
        TcpClient(LOCALHOST, server.port, EXAMPLE, protocol=1, shared_memory=True)
    # A reconnecting client asks too (and is told the same).
    with pytest.raises(SharedMemoryError, match=r"shared memory turned off"):
        TcpClient(LOCALHOST, server.port, EXAMPLE, reconnect=True, shared_memory=True)
    v1 = V1OnlyServer()
    try:
        import threading

        thread = threading.Thread(target=v1.serve_one, daemon=True)
        thread.start()
        with pytest.raises(SharedMemoryError, match=r"speaks only wire protocol 1"):
            TcpClient(LOCALHOST, v1.port, EXAMPLE, shared_memory=True)
        thread.join(WAIT_S)
    finally:
        v1.close()
    assert issubclass(SharedMemoryError, ConnectionError)


def test_transport_path_and_wait_and_close_flush_over_shared_memory(make_server: Any) -> None:
    server = _server(make_server, batch_size=4)
    baseline = _shm_fds()
    client = TcpClient(LOCALHOST, server.port, EXAMPLE, max_inflight_msgs=64)
    assert client.transport_path == "shm"
    assert "path='shm'" in repr(client)
    for i in range(8):
        client.send(_sample(i))
    client.wait(timeout=WAIT_S)
    assert client.acked == client.sent == 8
    for i in range(8, 12):
        client.send(_sample(i))
    assert client.close(timeout=WAIT_S)  # flushes: every committed sample taken
    assert client.transport_path == "shm"
    assert _receive(server, 12) == {0: list(range(12))}
    with pytest.raises(ConnectionClosedError):
        client.send(_sample(0))
    poll(server.stats, lambda s: s.active_connections == 0, "client gone")
    assert _shm_fds() == baseline


def test_send_batch_over_shared_memory_keeps_order(make_server: Any) -> None:
    server = _server(make_server, batch_size=10)
    with TcpClient(LOCALHOST, server.port, EXAMPLE, shared_memory=True) as client:
        rows = np.arange(30, dtype=np.int64)
        n = client.send_batch(
            {"id": rows, "obs": np.repeat(rows.astype(np.float32)[:, None], 3, axis=1)}
        )
        assert n == 30
    assert _receive(server, 30) == {0: list(range(30))}


@pytest.mark.serial
@pytest.mark.parametrize("blocked_in", ["send", "wait"])
def test_ctrl_c_interrupts_a_send_or_wait_blocked_on_shared_memory(blocked_in: str) -> None:
    code = textwrap.dedent(
        f"""
        from _blocked import after, announce_when
        import numpy as np
        import echo

        EXAMPLE = {{"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}}
        server = echo.Server(
            EXAMPLE, batch_size=1, num_buffers=2, num_drainers=1, producer_queue_size=1,
            transport=echo.TcpTransport(port=0, host="127.0.0.1"),
        )
        server.start()
        client = echo.TcpClient(
            "127.0.0.1", server.port, EXAMPLE, max_inflight_msgs=64, shared_memory=True
        )
        sample = {{"id": np.array(1, np.int64), "obs": np.ones((3,), np.float32)}}
        if {blocked_in!r} == "wait":
            for i in range(20):
                client.send(sample, timeout=5)
            announce_when(after(0.5))
            client.wait()
        else:
            announce_when(after(0.5))
            for i in range(100000):
                client.send(sample)
        """
    )
    assert_ctrl_c_interrupts_promptly(code)


def test_priorities_over_shared_memory_land_in_a_replay_table(make_server: Any) -> None:
    import echo

    server = _started(
        make_server,
        batch_size=4,
        sampler=echo.Prioritized(1.0),
        max_size=64,
    )
    priorities: list[float | None] = [0.5, 3.0, 1.25, None, 0.0, 2.5, None, 7.0]
    with TcpClient(LOCALHOST, server.port, EXAMPLE, shared_memory=True) as client:
        assert client.transport_path == "shm"
        for i, p in enumerate(priorities):
            client.send(_sample(i), priority=p, timeout=WAIT_S)
        client.wait(timeout=WAIT_S)
        with pytest.raises(ValueError, match="priority"):
            client.send(_sample(9), priority=-1.0)
    poll(server.stats, lambda s: s.samples_inserted_total == len(priorities), "all inserted")
    # A sample sent without a priority gets the largest seen so far, as over TCP.
    expected = [0.5, 3.0, 1.25, 3.0, 0.0, 2.5, 3.0, 7.0]
    assert [server._core.priority(k) for k in range(len(expected))] == expected


def test_a_fifo_server_refuses_priorities_over_shared_memory(make_server: Any) -> None:
    server = _server(make_server)
    with TcpClient(LOCALHOST, server.port, EXAMPLE, shared_memory=True) as client:
        with pytest.raises(ValueError, match="priorit"):
            client.send(_sample(0), priority=1.0)
        for i in range(1, 5):
            client.send(_sample(i))
    assert _receive(server, 4) == {0: [1, 2, 3, 4]}


def test_a_full_ring_leaves_samples_in_their_segments_and_order_holds(
    make_server: Any,
) -> None:
    # A ring of 8 samples and 3 workers of 200: the ring is full at once. The rest wait in
    # the workers' segments, untaken, never in the ingress queues (every sample is copied
    # once, straight from its segment), and go in, in order, as the learner frees room.
    server = _started(
        make_server,
        batch_size=4,
        num_buffers=2,
        producer_queue_size=4,
    )
    fleet = Fleet(server.port, 0, 3, 200, "true")
    try:
        poll(
            server.stats,
            lambda s: s.store_size == 8 and s.push_blocked_count >= 3,
            "every connection waiting for room in a full ring",
        )
        time.sleep(0.3)  # time enough for queues to fill, were samples copied into them
        held = server.stats()
        assert held.samples_inserted_total == 8
        # The ingress holds the three segments and not one pooled buffer: nothing was
        # copied into a queue. The segments are the connections' queues, so what waits in
        # them (as of each connection's last look) is queued and pending.
        assert held.buffered_bytes == 3 * (4096 + 1024 * 128)
        assert held.samples_pending == held.queue_depth_sum > 0
        assert 0 < held.queue_depth_max <= held.queue_depth_sum
        received = _receive(server, 3 * 200)
        assert fleet.finish() == ""
        assert {w: seqs == list(range(200)) for w, seqs in received.items()} == {
            0: True,
            1: True,
            2: True,
        }
        closed = fleet.reports("closed")
        assert sorted(closed) == [0, 1, 2]
        assert all(c[2] == "True" for c in closed.values())
        info = poll(server.stats, lambda s: s.active_connections == 0, "workers gone")
        assert info.shm_connections_total == 3
        assert info.samples_inserted_total == 600
        assert info.samples_pending == 0
    finally:
        fleet.kill()
        fleet.finish()


def test_segments_take_at_most_half_of_max_buffered_bytes(make_server: Any) -> None:
    # EXAMPLE's 20-byte samples: 1,024 slots of 128 bytes after a 4 KiB header. Half of
    # this budget holds one segment, not two.
    segment = 4096 + 1024 * 128
    server = _server(make_server, max_buffered_bytes=3 * segment)
    first = TcpClient(LOCALHOST, server.port, EXAMPLE, shared_memory=True)
    assert first.transport_path == "shm"
    assert server.stats().buffered_bytes >= segment
    with pytest.raises(SharedMemoryError, match=r"half of max_buffered_bytes\); a segment needs"):
        TcpClient(LOCALHOST, server.port, EXAMPLE, shared_memory=True)
    second = TcpClient(LOCALHOST, server.port, EXAMPLE)  # the default: TCP instead
    assert second.transport_path == "tcp"
    for k in range(4):
        first.send(_sample(k))
        second.send(_sample(ID_STRIDE + k))
    first.close()
    second.close()
    assert _receive(server, 8) == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}
    # The first segment's bytes are given back with it: the next worker gets one.
    poll(server.stats, lambda s: s.buffered_bytes < segment, "the segment's bytes given back")
    with TcpClient(LOCALHOST, server.port, EXAMPLE, shared_memory=True) as third:
        assert third.transport_path == "shm"


def test_a_rate_limited_replay_table_takes_shared_memory_samples_as_it_is_sampled(
    make_server: Any,
) -> None:
    import echo

    # Queue(4): an insert waits while 4 items are unsampled. Each connection's task waits
    # for the table (on its insert bell, not a thread), and each batch drawn lets more in.
    server = _started(
        make_server,
        batch_size=2,
        sampler=echo.Uniform(),
        max_size=8,
        rate_limiter=echo.Queue(4),
        max_times_sampled=1,
    )
    fleet = Fleet(server.port, 0, 2, 60, "true")
    try:
        got: dict[int, list[int]] = collections.defaultdict(list)
        for _ in range(60):
            sample = server.sample(timeout=2 * WAIT_S)
            for v in np.asarray(sample.batch["id"]).tolist():
                got[v // ID_STRIDE].append(v % ID_STRIDE)
        assert fleet.finish() == ""
        assert {w: sorted(seqs) for w, seqs in got.items()} == {
            0: list(range(60)),
            1: list(range(60)),
        }
        stats = server.stats()
        assert (stats.shm_connections_total, stats.samples_pending) == (2, 0)
        assert stats.push_blocked_count > 0, "the table never held a connection back"
    finally:
        fleet.kill()
        fleet.finish()


def test_a_worker_killed_while_the_ring_is_full_still_has_its_committed_samples_taken(
    make_server: Any,
) -> None:
    # A ring of 8 and a worker that committed 20, then is SIGKILLed. Its heartbeats (every
    # fraction of its 0.5 s timeout) can no longer be written once it is gone: that must stop
    # the heartbeats, not the channel. The 12 it committed to the segment still go in as the
    # learner frees room, as a dead TCP worker's bytes in the kernel are still read.
    server = _started(make_server, batch_size=4, num_buffers=2)
    code = textwrap.dedent(
        f"""
        import sys, time
        import numpy as np
        sys.path.insert(0, {str(HERE)!r})
        from _shm_worker import EXAMPLE
        import echo
        client = echo.TcpClient("127.0.0.1", {server.port}, EXAMPLE, shared_memory=True,
                                heartbeat_timeout=0.5)
        for i in range(20):
            client.send({{"id": np.array(i, np.int64), "obs": np.full((3,), i, np.float32)}})
        print(client.transport_path, flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert read_line(proc, 2 * WAIT_S).strip() == "shm"
        poll(server.stats, lambda s: s.store_size == 8, "a full ring")
    finally:
        proc.kill()
        proc.wait(timeout=WAIT_S)
        assert proc.stdout is not None
        proc.stdout.close()
    time.sleep(1.0)  # several heartbeats' time: writing them to the dead socket fails
    assert _receive(server, 20) == {0: list(range(20))}
