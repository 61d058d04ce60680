"""Sequence tables fed by rollout workers over TCP and same-host shared memory.

Workers are processes (`_sequence_worker.py`) whose every step carries a unique id, so the
learner can check each window: consecutive steps of one episode of one stream, in order, with
the mask, start and flags the episode's length gives, and every window the episodes should
give exactly once (LIFO, each window handed out once).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import WAIT_S, poll, read_line

import echo
from echo import Server, TcpClient, TcpTransport

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _sequence_worker import EXAMPLE, episode_length, step_id  # noqa: E402

LENGTH, PERIOD = 4, 2
Window = tuple[int, int, int, int]  # (stream of the ids, episode, start, real steps)


def model_windows(n: int, at_end: str) -> list[tuple[int, int]]:
    """The `(start, real steps)` windows of an ended episode of `n` steps."""
    whole = [(s, LENGTH) for s in range(0, n, PERIOD) if s + LENGTH <= n]
    pending = [s for s in range(0, n, PERIOD) if s + LENGTH > n]
    if at_end == "pad":
        return whole + [(s, n - s) for s in pending]
    if at_end == "shift" and pending:
        start = max(0, n - LENGTH)
        return whole + ([] if start in [s for s, _ in whole] else [(start, n - start)])
    return whole


def serve(at_end: str, **transport: Any) -> Server:
    server = Server(
        EXAMPLE,
        1,
        transport=TcpTransport(port=0, host="127.0.0.1", **transport),
        sequence=echo.Sequence(LENGTH, period=PERIOD, at_end=at_end),  # pyright: ignore[reportArgumentType]
        sampler=echo.Lifo(),
        max_times_sampled=1,
        max_size=100_000,
    )
    server.start()
    return server


class Fleet:
    """Worker processes forked by one `_sequence_worker.py`, and the lines they reported."""

    def __init__(self, port: int, num: int, mode: str, shm: bool, episodes: int, rows: int = 1):
        args = [str(a) for a in (port, 0, num, mode, "true" if shm else "false", episodes, rows)]
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "_sequence_worker.py"), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
        )
        self.lines: list[list[str]] = []

    def read_until(self, kind: str, count: int) -> list[list[str]]:
        deadline = time.monotonic() + 4 * WAIT_S
        while sum(line[0] == kind for line in self.lines) < count:
            left = deadline - time.monotonic()
            assert left > 0, f"{count} {kind!r} lines not reported: {self.lines}"
            raw = read_line(self.proc, left)
            assert raw, f"the fleet ended early: {self.lines} {self.finish()}"
            self.lines.append(raw.split(maxsplit=3))
        errors = [line for line in self.lines if line[0] == "error"]
        assert not errors, errors
        return [line for line in self.lines if line[0] == kind]

    def pids(self) -> list[int]:
        return [int(line[2]) for line in self.lines if line[0] == "pid"]

    def finish(self) -> str:
        try:
            _, err = self.proc.communicate(timeout=4 * WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            _, err = self.proc.communicate()
        return err

    def kill(self) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()


def drain(
    server: Server, length_of: Callable[[int, int], int] = episode_length
) -> tuple[list[Window], dict[int, set[int]]]:
    """Every window once (LIFO, each handed out once), checked against the episodes' lengths
    (`length_of(stream, episode)`); and by id stream, the server streams its windows came
    from."""
    got: list[Window] = []
    streams: dict[int, set[int]] = {}
    while server.stats().store_size:
        sample = server.sample(timeout=WAIT_S)
        assert sample is not None
        mask, start, stream = sample.mask, sample.start, sample.stream
        assert mask is not None and start is not None and stream is not None  # noqa: PT018
        is_last, ended = sample.is_last, sample.terminated | sample.truncated  # type: ignore[operator]
        assert is_last is not None
        ids = sample.batch["id"][0]
        real = int(mask[0].sum())
        assert mask[0, :real].all() and not mask[0, real:].any()  # noqa: PT018
        np.testing.assert_array_equal(
            sample.batch["obs"][0, :real, 0], ids[:real].astype(np.float32)
        )
        assert not ids[real:].any(), "padding is zeros"
        first = int(ids[0])
        assert ids[:real].tolist() == list(range(first, first + real))
        k, e, s = first // 10**6, first // 10**3 % 10**3, first % 10**3
        assert s == int(start[0])
        n = length_of(k, e)
        assert bool(ended[0]), "every episode has ended"
        expected_last = [s + j == n - 1 for j in range(LENGTH)]
        assert is_last[0].tolist() == [x and j < real for j, x in enumerate(expected_last)]
        got.append((k, e, s, real))
        streams.setdefault(k, set()).add(int(stream[0]))
    return sorted(got), streams


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
@pytest.mark.parametrize("workers", [1, 8, 64])
def test_interleaved_workers_streams_each_window_once_and_whole(workers: int, shm: bool) -> None:
    at_end = ["pad", "shift", "drop"][workers % 3]
    server = serve(at_end)
    fleet = Fleet(server.port or 0, workers, "send", shm, episodes=3)
    try:
        fleet.read_until("done", workers)
        total = sum(episode_length(w, e) for w in range(workers) for e in range(3))
        poll(server.stats, lambda s: s.steps_inserted_total == total, "every step in")
        info = poll(server.stats, lambda s: s.episodes_ended_total == 3 * workers, "ended")
        assert info.streams_open == 0
        if shm:
            assert info.shm_connections_total == workers
        got, streams = drain(server)
    finally:
        fleet.kill()
        fleet.finish()
        server.close()
    expected = sorted(
        (w, e, s, real)
        for w in range(workers)
        for e in range(3)
        for s, real in model_windows(episode_length(w, e), at_end)
    )
    assert got == expected
    # One server stream per worker, a different one for each.
    assert all(len(s) == 1 for s in streams.values()), streams
    assert len({next(iter(s)) for s in streams.values()}) == len(streams)


def test_a_vector_env_is_one_stream_per_row_and_open_episodes_end_when_it_closes() -> None:
    rows, workers = 4, 2
    # Row k's episodes over its 40 steps: whole ones, then the last, cut short (truncated
    # when the worker closes).
    lengths: dict[tuple[int, int], int] = {}
    for k in range(workers * rows):
        done, e = 0, 0
        while done < 40:
            lengths[k, e] = min(episode_length(k, e), 40 - done)
            done, e = done + lengths[k, e], e + 1
    server = serve("pad")
    fleet = Fleet(server.port or 0, workers, "batch", shm=False, episodes=2, rows=rows)
    try:
        fleet.read_until("done", workers)
        info = poll(server.stats, lambda s: s.streams_open == 0, "the open episodes ended")
        assert info.steps_inserted_total == workers * rows * 40
        got, streams = drain(server, lambda k, e: lengths[k, e])
    finally:
        fleet.kill()
        fleet.finish()
        server.close()
    expected = sorted(
        (k, e, s, real) for (k, e), n in lengths.items() for s, real in model_windows(n, "pad")
    )
    assert got == expected
    assert len(streams) == workers * rows
    server_streams = {next(iter(s)) for s in streams.values()}
    assert len(server_streams) == workers * rows, "one server stream per row"
    assert all(s >= 2**32 for s in server_streams), "TCP streams are above in-process ids"


def test_a_killed_worker_has_its_episode_truncated_and_its_windows_kept() -> None:
    server = serve("pad", session_timeout=0.5, heartbeat_timeout=0.5)
    fleet = Fleet(server.port or 0, 1, "hold", shm=True, episodes=9)
    try:
        fleet.read_until("ready", 1)
        info = poll(server.stats, lambda s: s.steps_inserted_total == 9, "the 9 steps in")
        assert info.store_size == 3, "windows 0, 2, 4 of 4 steps"
        assert info.streams_open == 1
        for pid in fleet.pids():
            os.kill(pid, signal.SIGKILL)
        info = poll(server.stats, lambda s: s.streams_open == 0, "the episode truncated")
        assert info.episodes_ended_total == 1
        assert info.store_size == 5, "and its last windows, padded (starts 6 and 8)"
        for start, is_last in ((8, [True, False, False, False]), (6, [False, False, True, False])):
            sample = server.sample(timeout=WAIT_S)  # LIFO: the newest first
            assert sample is not None
            assert sample.truncated is not None
            assert bool(sample.truncated[0])
            assert sample.start is not None
            assert int(sample.start[0]) == start
            assert sample.is_last is not None
            assert sample.is_last[0].tolist() == is_last
    finally:
        fleet.kill()
        fleet.finish()
        server.close()


def test_a_reconnecting_client_continues_its_episode() -> None:
    server = serve("drop")
    proxy = subprocess.Popen(
        [sys.executable, str(HERE / "_proxy.py"), "--target-port", str(server.port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(read_line(proxy, WAIT_S).split()[1])
        client = TcpClient(
            "127.0.0.1", port, EXAMPLE, reconnect=True, reconnect_timeout=20.0, shared_memory=False
        )
        for i in range(6):
            client.send({"id": np.array(step_id(0, 0, i)), "obs": np.full(3, i, np.float32)})
        client.wait(timeout=WAIT_S)
        assert proxy.stdin is not None
        proxy.stdin.write("drop\n")
        proxy.stdin.flush()
        assert read_line(proxy, WAIT_S).startswith("ok drop")
        for i in range(6, 10):
            client.send(
                {"id": np.array(step_id(0, 0, i)), "obs": np.full(3, i, np.float32)},
                end_episode=i == 9,
                timeout=WAIT_S,
            )
        client.wait(timeout=3 * WAIT_S)
        assert client.reconnects == 1
        info = poll(server.stats, lambda s: s.episodes_ended_total == 1, "the episode ended")
        assert info.streams_open == 0
        client.close(timeout=WAIT_S)
        got, streams = drain(server, lambda k, e: 10)
    finally:
        with contextlib.suppress(OSError, ValueError):
            proxy.communicate("quit\n", timeout=WAIT_S)
        if proxy.poll() is None:
            proxy.kill()
        server.close()
    # One episode of 10 steps across the reconnect: windows at 0, 2, 4, 6 (drop: 8 is cut).
    assert [(e, s, real) for _, e, s, real in got] == [(0, s, 4) for s in (0, 2, 4, 6)]
    assert len(streams[0]) == 1, "the same stream before and after the reconnect"


def test_episode_flags_need_a_sequence_table_at_the_server() -> None:
    for kwargs in ({}, {"sampler": echo.Uniform(), "max_size": 100}):
        server = Server(EXAMPLE, 2, transport=TcpTransport(port=0, host="127.0.0.1"), **kwargs)
        server.start()
        try:
            client = TcpClient("127.0.0.1", server.port or 0, EXAMPLE)
            assert client.sequence_rows is None
            step = {"id": np.array(1), "obs": np.zeros(3, np.float32)}
            with pytest.raises(ValueError, match="need a sequence table at the server"):
                client.send(step, end_episode=True)
            batch = {"id": np.arange(2), "obs": np.zeros((2, 3), np.float32)}
            with pytest.raises(ValueError, match="need a sequence table at the server"):
                client.send_batch(batch, truncated=np.array([False, True]))
            client.send(step)  # a plain sample still goes
            client.close(timeout=WAIT_S)
        finally:
            server.close()
    server = serve("pad")
    try:
        client = TcpClient("127.0.0.1", server.port or 0, EXAMPLE, max_inflight_msgs=4)
        assert client.sequence_rows == 4096
        too_many = {"id": np.arange(4097), "obs": np.zeros((4097, 3), np.float32)}
        with pytest.raises(ValueError, match=r"row 4096 out of range"):
            client.send_batch(too_many)
        client.close(timeout=WAIT_S)
        assert server.stats().steps_inserted_total == 0, "nothing of the refused batch went in"
    finally:
        server.close()


def test_a_wire_v1_client_is_one_episode_that_ends_truncated_with_its_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = serve("pad")
    caplog.set_level("WARNING", logger="echo")
    echo.reset_log_cache()
    try:
        # Two v1 clients: the server says once that v1 has no episode flags.
        TcpClient("127.0.0.1", server.port or 0, EXAMPLE, protocol=1).close(timeout=WAIT_S)
        client = TcpClient("127.0.0.1", server.port or 0, EXAMPLE, protocol=1)
        assert client.sequence_rows is None, "wire v1 carries no episode flags"
        for i in range(7):
            v = step_id(5, 0, i)
            client.send({"id": np.array(v), "obs": np.full(3, v, np.float32)})
        with pytest.raises(ValueError, match="speaks wire protocol 1, which has no episodes"):
            client.send({"id": np.array(0), "obs": np.zeros(3, np.float32)}, end_episode=True)
        client.wait(timeout=WAIT_S)  # acknowledged: queued, maybe not yet in the table
        info = poll(server.stats, lambda s: s.steps_inserted_total == 7, "the 7 steps in")
        assert info.streams_open == 1
        warned = [r.getMessage() for r in caplog.records if "wire v1 client" in r.getMessage()]
        assert len(warned) == 1, warned
        assert "no episode flags" in warned[0], warned[0]
        assert "protocol 2" in warned[0], warned[0]
        client.close(timeout=WAIT_S)
        info = poll(server.stats, lambda s: s.streams_open == 0, "the connection's episode ended")
        assert info.episodes_ended_total == 1
        got, streams = drain(server, lambda k, e: 7)
    finally:
        server.close()
    assert got == [(5, 0, s, real) for s, real in model_windows(7, "pad")]
    assert next(iter(streams[5])) >= 2**32


def test_a_checkpoint_keeps_queued_steps_and_ends_tcp_streams_truncated(tmp_path: Path) -> None:
    # Queue(1) holds inserts while one window is unsampled: steps 1.. wait in the ingress,
    # acknowledged, when the checkpoint is taken.
    server = Server(
        EXAMPLE,
        1,
        transport=TcpTransport(port=0, host="127.0.0.1"),
        sequence=echo.Sequence(2, at_end="pad"),
        sampler=echo.Lifo(),
        rate_limiter=echo.Queue(1),
        max_times_sampled=1,
        max_size=1000,
    )
    server.start()
    try:
        client = TcpClient("127.0.0.1", server.port or 0, EXAMPLE, shared_memory=False)
        for i in range(6):
            v = step_id(3, 0, i)
            client.send({"id": np.array(v), "obs": np.full(3, v, np.float32)})
        client.wait(timeout=WAIT_S)
        poll(server.stats, lambda s: s.samples_pending == 4, "steps 2..5 queued")
        assert server.stats().store_size == 1
        server.checkpoint(tmp_path / "ckpt")
        client.close(timeout=WAIT_S)
    finally:
        server.close()
    restored = Server.restore(tmp_path / "ckpt")
    try:
        info = restored.stats()
        assert info.steps_stored == 6, "the queued steps went in"
        assert info.streams_open == 0, "the TCP client's episode ended at the restore"
        assert info.episodes_ended_total == 1
        got = []
        while restored.stats().store_size:
            sample = restored.sample(timeout=WAIT_S)
            assert sample is not None
            assert sample.truncated is not None
            assert sample.start is not None
            got.append((int(sample.start[0]), bool(sample.truncated[0])))
    finally:
        restored.close()
    # Windows of 2 every 2 steps of the one 6-step episode, newest first, all truncated.
    assert sorted(got) == [(0, True), (2, True), (4, True)]
