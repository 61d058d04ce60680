"""Policy versions on ragged samples: each sample's version handed out with its batch,
stale samples dropped as they go in and skipped (counted once) when they went stale while
they waited, FIFO and replay, in-process and from workers over TCP and shared memory, and
kept by checkpoints."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import echo
from echo import Ragged

SHM = pytest.mark.skipif(sys.platform != "linux", reason="shared memory needs Linux")


def example() -> dict[str, Any]:
    return {
        "tokens": Ragged(64, np.int32, group="completion"),
        "logp": Ragged(64, np.float32, group="completion"),
        "id": np.zeros((), np.int64),
    }


def make(i: int) -> dict[str, Any]:
    n = i % 17
    return {
        "tokens": np.arange(n, dtype=np.int32) + i,
        "logp": -np.arange(n, dtype=np.float32),
        "id": np.int64(i),
    }


def weights(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full(4, step, np.float32)}


def drain(server: echo.Server) -> tuple[list[int], list[int]]:
    """Every batch a closing FIFO server still hands out: (ids, versions)."""
    server.close(drain=True)
    ids: list[int] = []
    versions: list[int] = []
    while (s := server.sample(timeout=5)) is not None:
        assert s.versions is not None
        assert s.versions.dtype == np.uint64
        assert s.versions.shape == (s.num_samples,)
        ids.extend(int(i) for i in s.batch["id"])
        versions.extend(int(v) for v in s.versions)
    return ids, versions


def test_fifo_hands_out_versions_and_drops_stale_samples_at_insert_and_while_waiting() -> None:
    server = echo.Server(example(), batch_size=4, num_buffers=8, max_staleness=2)
    assert server.publish(weights(10), version=10) == 10
    assert server.params_version == 10
    # 7 is more than 2 behind 10: dropped as it goes in; the rest wait.
    for i, v in enumerate([10, 7, 8, 9, 10, 10]):
        server.submit(make(i), version=v)
    server.submit(make(6))  # the latest published: 10
    # A group goes in or is dropped whole: 7 makes the whole group stale.
    server.submit_group([make(7), make(8)], version=7)
    stats = server.stats()
    assert stats.samples_stale_at_insert_total == 3
    assert stats.store_size == 6
    # 12: 8 and 9 are stale now, while they wait; skipped when batches are made.
    server.publish(weights(12), version=12)
    ids, versions = drain(server)
    assert ids == [0, 4, 5, 6]
    assert versions == [10, 10, 10, 10]
    stats = server.stats()
    assert stats.samples_stale_at_sample_total == 2
    assert stats.samples_versioned_total == 4
    assert stats.version_lag_max == 2


@pytest.mark.parametrize("sampler", [echo.Uniform(), echo.Prioritized(0.6)])
def test_replay_removes_an_entry_a_draw_finds_stale_and_draws_again(sampler: Any) -> None:
    server = echo.Server(example(), batch_size=8, sampler=sampler, max_size=100, max_staleness=1)
    server.publish(weights(1))
    for i in range(40):
        server.submit(make(i), version=1 + (i % 2))  # even ids: 1, odd ids: 2
    server.publish(weights(3), version=3)  # floor 2: the even ids are stale now
    seen: set[int] = set()
    for _ in range(50):
        s = server.sample(timeout=5)
        assert s is not None
        assert s.versions is not None
        assert set(s.versions.tolist()) == {2}
        seen.update(int(i) for i in s.batch["id"])
    assert seen == set(range(1, 40, 2))
    stats = server.stats()
    assert stats.samples_stale_at_sample_total == 20, "each stale entry removed once"
    assert stats.store_size == 20
    server.close()


def test_versions_are_only_recorded_without_a_bound_and_refused_without_versions() -> None:
    server = echo.Server(example(), batch_size=2, policy_versions=True)
    server.submit(make(1), version=3)
    server.submit(make(2))  # nothing published: 0
    s = server.sample(timeout=5)
    assert s is not None
    assert s.versions is not None
    assert s.versions.tolist() == [3, 0]
    server.close()
    plain = echo.Server(example(), batch_size=2)
    with pytest.raises(ValueError, match="version= needs a server that keeps policy versions"):
        plain.submit(make(1), version=3)
    plain.submit(make(1))
    plain.submit(make(2))
    s = plain.sample(timeout=5)
    assert s is not None
    assert s.versions is None
    assert plain.publish(weights(1)) == 1  # a version, published as on any server
    with pytest.raises(ValueError, match="not above the latest"):
        plain.publish(weights(1), version=1)
    with pytest.raises(ValueError, match="shape"):
        plain.publish({"w": np.zeros(5, np.float32)})
    plain.close()
    with pytest.raises(ValueError, match="admission='block' needs max_staleness"):
        echo.Server(example(), batch_size=2, policy_versions=True, admission="block")


@pytest.mark.parametrize("path", ["tcp", pytest.param("shm", marks=SHM)])
def test_workers_tag_their_samples_and_stale_ones_never_reach_the_learner(path: str) -> None:
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    server = echo.Server(example(), batch_size=4, num_buffers=16, transport=transport,
                         max_staleness=1)  # fmt: skip
    server.start()
    assert server.port is not None
    server.publish(weights(5), version=5)
    client = echo.TcpClient("127.0.0.1", server.port, example(), shared_memory=path == "shm")
    assert client.transport_path == path
    assert client.keeps_versions
    assert client.policy_version == 0
    client.policy_version = 5
    for i in range(4):
        client.send(make(i))  # 5
    client.send(make(4), version=3)  # stale already: dropped
    client.send_group([make(5), make(6)], version=4)
    client.send(make(7), version=5)
    client.wait(10)
    assert client.acked == client.sent == 8  # a dropped sample is acknowledged too
    server.publish(weights(6))  # floor 5: the group of version 4 is stale now
    client.close()
    ids, versions = drain(server)
    assert ids == [0, 1, 2, 3, 7]
    assert versions == [5, 5, 5, 5, 5]
    stats = server.stats()
    assert (stats.samples_stale_at_insert_total, stats.samples_stale_at_sample_total) == (1, 2)


def test_a_worker_without_versions_is_told_and_a_plain_server_takes_no_version() -> None:
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    with echo.Server(example(), batch_size=2, transport=transport) as server:
        assert server.port is not None
        with echo.TcpClient("127.0.0.1", server.port, example()) as client:
            assert not client.keeps_versions
            with pytest.raises(ValueError, match="version= needs a server that keeps"):
                client.send(make(1), version=2)
            client.send(make(1))
            client.wait(10)
            assert client.sent == 1


def test_a_checkpoint_keeps_versions_and_the_latest_published_version(tmp_path: Path) -> None:
    server = echo.Server(example(), batch_size=4, sampler=echo.Uniform(), max_size=50,
                         max_staleness=3, seed=1)  # fmt: skip
    server.publish(weights(7), version=7)
    for i in range(10):
        server.submit(make(i), version=4 + (i % 4))  # 4, 5, 6, 7
    server.checkpoint(tmp_path / "ckpt")
    server.close()
    restored = echo.Server.restore(tmp_path / "ckpt", example())
    try:
        assert restored.params_version == 7
        assert restored.stats().store_size == 10
        found: dict[int, int] = {}
        for _ in range(100):
            s = restored.sample(timeout=5)
            assert s is not None
            assert s.versions is not None
            found.update(zip(s.batch["id"].tolist(), s.versions.tolist(), strict=True))
            if len(found) == 10:
                break
        assert found == {i: 4 + (i % 4) for i in range(10)}
        restored.publish(weights(8))  # floor 5: the version-4 samples go stale
        for _ in range(30):
            s = restored.sample(timeout=5)
            assert s is not None
            assert s.versions is not None
            assert min(s.versions.tolist()) >= 5
        assert restored.stats().samples_stale_at_sample_total == 3  # ids 0, 4, 8
    finally:
        restored.close()


@pytest.mark.parametrize("path", ["tcp", pytest.param("shm", marks=SHM)])
def test_block_admission_holds_a_worker_back_until_it_acts_with_newer_weights(path: str) -> None:
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    server = echo.Server(example(), batch_size=2, num_buffers=8, transport=transport,
                         max_staleness=1, admission="block")  # fmt: skip
    server.start()
    assert server.port is not None
    server.publish(weights(1))
    client = echo.TcpClient("127.0.0.1", server.port, example(), shared_memory=path == "shm")
    assert client.keeps_versions
    deadline = time.monotonic() + 10
    while client.params_version < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.params_version == 1, "the latest version, told at once"
    client.policy_version = 1
    client.send(make(0))
    server.publish(weights(2))
    server.publish(weights(3))  # the worker is 2 behind now
    while client.params_version < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.params_version == 3, "each publish announced"
    with pytest.raises(TimeoutError, match="acts with version 1 and the learner is at 3"):
        client.send(make(1), timeout=0.1)
    # Another thread of the worker switches to newer weights: the waiting send goes on.
    switch = threading.Timer(0.2, lambda: setattr(client, "policy_version", 3))
    switch.start()
    client.send(make(2), timeout=10)
    switch.join()
    client.send(make(3), version=2)  # a named version within the bound goes at once
    client.wait(10)
    assert client.admission_waits == 2  # the send that timed out, and the one that waited
    assert client.admission_wait_s >= 0.1
    client.close()
    ids, versions = drain(server)
    assert ids == [0, 2, 3]
    assert versions == [1, 3, 2]
    stats = server.stats()  # "block" keeps the bound at the source and drops nothing
    assert (stats.samples_stale_at_insert_total, stats.samples_stale_at_sample_total) == (0, 0)
