"""Durable ragged workers: every frame kept until a checkpoint the learner completed holds
it, so a learner restored from its latest checkpoint ends with exactly the samples sent
(none lost, none twice), over TCP and shared memory; the byte budget of what is kept."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import echo
from echo import Ragged

SHM = pytest.mark.skipif(sys.platform != "linux", reason="shared memory needs Linux")
PATHS = ["tcp", pytest.param("shm", marks=SHM)]


def example() -> dict[str, Any]:
    return {
        "tokens": Ragged(200, np.int32, group="completion"),
        "logp": Ragged(200, np.float32, group="completion"),
        "id": np.zeros((), np.int64),
    }


def make(i: int) -> dict[str, Any]:
    n = (i * 37) % 201
    return {
        "tokens": np.arange(n, dtype=np.int32) + i,
        "logp": np.full(n, -float(i), np.float32),
        "id": np.int64(i),
    }


def ids_of(server: echo.Server) -> list[int]:
    """Every id a replay server holds (each entry drawn until all were seen)."""
    n = server.stats().store_size
    seen: set[int] = set()
    for _ in range(10_000):
        if len(seen) == n:
            break
        s = server.sample(timeout=5)
        assert s is not None
        tokens_of = np.split(s.batch["tokens"].values, s.batch["tokens"].cu_seqlens[1:-1])
        for i, tokens in zip(s.batch["id"], tokens_of, strict=True):
            assert np.array_equal(tokens, make(int(i))["tokens"]), "a sample arrived whole"
            seen.add(int(i))
    assert len(seen) == n
    return sorted(seen)


@pytest.mark.parametrize("path", PATHS)
def test_a_restored_learner_ends_with_exactly_the_samples_sent(path: str, tmp_path: Path) -> None:
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    first = echo.Server(example(), 8, transport, sampler=echo.Uniform(), max_size=1000)
    first.start()
    port = first.port
    assert port is not None
    client = echo.TcpClient("127.0.0.1", port, example(), durable=True, reconnect_timeout=30,
                            shared_memory=path == "shm")  # fmt: skip
    assert client.durable
    assert client.transport_path == path
    for i in range(40):
        client.send(make(i), timeout=30)
    client.wait(30)
    assert client.persisted == 0
    assert client.retained_bytes > 0, "acknowledged, not persisted: kept"
    first.checkpoint(tmp_path / "ckpt")
    client.wait_persisted(30)
    assert client.persisted == 40
    assert client.retained_bytes == 0
    # Stored and acknowledged, but in no checkpoint: lost with the learner.
    for i in range(40, 60):
        client.send(make(i), timeout=30)
    client.wait(30)
    assert client.acked == 60
    assert client.persisted == 40
    first.close(restarting=True)
    again = echo.TcpTransport(port=port, host="127.0.0.1")
    second = echo.Server.restore(tmp_path / "ckpt", example(), transport=again)
    second.start()
    try:
        for i in range(60, 80):
            client.send(make(i), timeout=30)
        client.wait(30)
        assert client.reconnects >= 1
        assert client.resumed_from == 40, "the checkpoint's count"
        assert client.resent == 20
        second.checkpoint(tmp_path / "ckpt")
        assert client.close(timeout=30), "every sample persisted"
        assert client.given_up == 0
        assert ids_of(second) == list(range(80)), "every sample once"
    finally:
        second.close()


def test_a_durable_worker_waits_for_room_until_a_checkpoint_frees_it(tmp_path: Path) -> None:
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    server = echo.Server(example(), 8, transport, sampler=echo.Uniform(), max_size=1000,
                         checkpoint_dir=tmp_path, checkpoint_every=0.2)  # fmt: skip
    server.start()
    assert server.port is not None
    try:
        with echo.TcpClient("127.0.0.1", server.port, example(), durable=True,
                            durable_bytes=20_000) as client:  # fmt: skip
            started = time.monotonic()
            for i in range(60):  # ~1 KB each: many times the budget
                client.send(make(i), timeout=30)
                assert client.retained_bytes <= 20_000 + 2_000
            assert client.durable_waits >= 1
            assert client.durable_wait_s > 0
            assert time.monotonic() - started < 30
            client.wait_persisted(30)
            assert client.persisted == 60
        assert client.given_up == 0
        assert ids_of(server) == list(range(60))
    finally:
        server.close()
