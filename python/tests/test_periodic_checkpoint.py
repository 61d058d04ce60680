"""Periodic checkpoints (issue #13): `Server(checkpoint_dir=..., checkpoint_every=...,
checkpoint_keep=...)` rotates, survives failures, reports in `stats()` and stops on close."""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from echo import Fifo, Server, Uniform
from echo import checkpoint as ckpt
from echo.checkpoint import PeriodicCheckpointer, periodic_checkpoints

EVERY = 0.05


def example() -> dict[str, Any]:
    return {"obs": np.zeros((4,), np.float32), "id": np.zeros((), np.int64)}


def item(i: int) -> dict[str, Any]:
    return {"obs": np.full((4,), i, np.float32), "id": np.array(i, np.int64)}


def periodic_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == PeriodicCheckpointer.THREAD_NAME]


def wait_until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def replay_server(tmp_path: Path, **kwargs: Any) -> Server:
    return Server(example(), 2, sampler=Uniform(), max_size=100, seed=1, **kwargs)


def numbers(directory: Path) -> list[int]:
    return [int(Path(p).name.removeprefix("ckpt-")) for p in periodic_checkpoints(directory)]


def test_rotation_keeps_exactly_the_newest_and_each_is_restorable(tmp_path: Path) -> None:
    directory = tmp_path / "ckpts"
    server = replay_server(
        tmp_path, checkpoint_dir=directory, checkpoint_every=EVERY, checkpoint_keep=2
    )
    try:
        for i in range(10):
            server.submit(item(i))
        wait_until(lambda: numbers(directory) and numbers(directory)[-1] >= 4)
    finally:
        server.close()
    kept = numbers(directory)
    assert len(kept) == 2
    assert kept == [kept[-1] - 1, kept[-1]]
    # Only the kept links and their data directories remain: rotation leaves nothing behind.
    data_dirs = {os.path.realpath(p) for p in periodic_checkpoints(directory)}
    hidden = {str(directory / e) for e in os.listdir(directory) if e.startswith(".")}
    assert hidden == data_dirs
    for path in periodic_checkpoints(directory):
        restored = Server.restore(path)
        try:
            assert restored.stats().store_size == 10
            batch = restored.sample(timeout=5)
            assert batch is not None
            np.testing.assert_array_equal(batch.batch["obs"][:, 0], batch.batch["id"])
        finally:
            restored.close()


def test_numbering_continues_above_existing_checkpoints(tmp_path: Path) -> None:
    directory = tmp_path / "ckpts"
    first = replay_server(tmp_path, checkpoint_dir=directory, checkpoint_every=EVERY)
    first.submit(item(1))
    wait_until(lambda: len(numbers(directory)) >= 1)
    first.close()
    top = numbers(directory)[-1]
    restored = Server.restore(
        periodic_checkpoints(directory)[-1], checkpoint_dir=directory, checkpoint_every=EVERY
    )
    try:
        wait_until(lambda: numbers(directory)[-1] > top)
    finally:
        restored.close()
    assert len(numbers(directory)) <= 3


def test_a_failed_checkpoint_is_logged_and_the_next_period_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_write = ckpt.write
    calls: list[str] = []

    def failing_once(*args: Any) -> int:
        calls.append("call")
        if len(calls) == 1:
            raise OSError(28, "No space left on device (injected)")
        return real_write(*args)

    monkeypatch.setattr(ckpt, "write", failing_once)
    directory = tmp_path / "ckpts"
    caplog.set_level(logging.ERROR, logger="echo")
    server = replay_server(tmp_path, checkpoint_dir=directory, checkpoint_every=EVERY)
    try:
        server.submit(item(7))
        wait_until(lambda: len(numbers(directory)) >= 1)
        # The server kept serving through the failure.
        server.submit(item(8))
        assert server.sample(timeout=5) is not None
    finally:
        server.close()
    failures = [r for r in caplog.records if r.name == "echo" and "failed" in r.getMessage()]
    assert failures
    assert failures[0].exc_info is not None
    assert "injected" in str(failures[0].exc_info[1])


def test_stats_report_the_last_checkpoint(tmp_path: Path) -> None:
    server = replay_server(tmp_path)
    try:
        info = server.stats()
        assert (info.last_checkpoint_unix_s, info.last_checkpoint_duration_s) == (0.0, 0.0)
        assert info.last_checkpoint_bytes == 0
        server.submit(item(1))
        before = time.time()
        server.checkpoint(tmp_path / "manual")
        info = server.stats()
        assert before <= info.last_checkpoint_unix_s <= time.time()
        assert 0 < info.last_checkpoint_duration_s < 60
        real = tmp_path / os.readlink(tmp_path / "manual")
        assert info.last_checkpoint_bytes == sum(f.stat().st_size for f in real.iterdir())
        as_dict = info.as_dict()
        assert as_dict["last_checkpoint_bytes"] == info.last_checkpoint_bytes
        assert as_dict["last_checkpoint_unix_s"] == info.last_checkpoint_unix_s
        again = pickle.loads(pickle.dumps(info))
        assert again.last_checkpoint_duration_s == info.last_checkpoint_duration_s
        assert again.last_checkpoint_bytes == info.last_checkpoint_bytes
    finally:
        server.close()


def test_stats_advance_with_periodic_checkpoints(tmp_path: Path) -> None:
    directory = tmp_path / "ckpts"
    server = replay_server(tmp_path, checkpoint_dir=directory, checkpoint_every=EVERY)
    try:
        server.submit(item(1))
        wait_until(lambda: server.stats().last_checkpoint_unix_s > 0)
        first = server.stats()
        for i in range(2, 50):
            server.submit(item(i))
        wait_until(lambda: server.stats().last_checkpoint_unix_s > first.last_checkpoint_unix_s)
        wait_until(lambda: server.stats().last_checkpoint_bytes > first.last_checkpoint_bytes)
    finally:
        server.close()


def test_close_joins_the_thread(tmp_path: Path) -> None:
    server = replay_server(tmp_path, checkpoint_dir=tmp_path / "c", checkpoint_every=EVERY)
    assert len(periodic_threads()) == 1
    server.submit(item(1))
    wait_until(lambda: len(numbers(tmp_path / "c")) >= 1)
    server.close()
    assert periodic_threads() == []
    server.close()  # idempotent


def test_close_during_a_slow_checkpoint_finishes_or_abandons_it_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = threading.Event()

    def slow(stage: str) -> None:
        if stage == "leaves-written":
            started.set()
            time.sleep(0.3)

    monkeypatch.setattr(ckpt, "_test_hook", slow)
    directory = tmp_path / "c"
    server = replay_server(tmp_path, checkpoint_dir=directory, checkpoint_every=EVERY)
    server.submit(item(1))
    assert started.wait(10)
    server.close()
    assert periodic_threads() == []
    # Whatever is left is a complete, restorable checkpoint (or nothing), no partial files.
    for path in periodic_checkpoints(directory):
        Server.restore(path).close()
    links = set(periodic_checkpoints(directory))
    data = {e for e in os.listdir(directory) if e.startswith(".")}
    assert len(data) == len(links)


def test_without_close_the_thread_does_not_keep_the_server_alive(tmp_path: Path) -> None:
    server = replay_server(tmp_path, checkpoint_dir=tmp_path / "c", checkpoint_every=EVERY)
    del server
    wait_until(lambda: periodic_threads() == [])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"checkpoint_every": 1.0}, ValueError, "checkpoint_every needs checkpoint_dir"),
        ({"checkpoint_dir": "x"}, ValueError, "checkpoint_dir needs checkpoint_every"),
        ({"checkpoint_dir": "x", "checkpoint_every": 0}, ValueError, "positive"),
        ({"checkpoint_dir": "x", "checkpoint_every": -1.0}, ValueError, "positive"),
        ({"checkpoint_dir": "x", "checkpoint_every": float("nan")}, ValueError, "positive"),
        ({"checkpoint_dir": "x", "checkpoint_every": float("inf")}, ValueError, "finite"),
        ({"checkpoint_dir": "x", "checkpoint_every": "1"}, TypeError, "checkpoint_every"),
        (
            {"checkpoint_dir": "x", "checkpoint_every": 1, "checkpoint_keep": 0},
            ValueError,
            r"checkpoint_keep must be >= 1, got 0",
        ),
        ({"checkpoint_keep": True}, TypeError, "checkpoint_keep must be an int"),
        ({"checkpoint_dir": 3, "checkpoint_every": 1}, TypeError, "checkpoint_dir"),
    ],
)
def test_argument_errors(
    tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        replay_server(tmp_path, **kwargs)
    assert periodic_threads() == []


def test_a_fifo_server_writes_periodic_checkpoints_that_restore(tmp_path: Path) -> None:
    directory = tmp_path / "ckpts"
    server = Server(example(), 2, sampler=Fifo(), checkpoint_dir=directory, checkpoint_every=EVERY)
    try:
        for i in range(5):
            server.submit(item(i))
        first = server.sample(timeout=5)
        assert first is not None
        np.testing.assert_array_equal(first.batch["id"], [0, 1])
        # A checkpoint that starts after this point holds 2, 3, 4 (4 a partial batch).
        start = len(numbers(directory))
        wait_until(lambda: len(numbers(directory)) >= start + 2)
    finally:
        server.close()
    restored = Server.restore(periodic_checkpoints(directory)[-1])
    with restored:
        assert restored.stats().store_size == 3
        restored.submit(item(5))
        for expected in ([2, 3], [4, 5]):
            batch = restored.sample(timeout=5)
            assert batch is not None
            np.testing.assert_array_equal(batch.batch["id"], expected)
