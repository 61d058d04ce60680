"""Parameters down to ragged workers: `params()` over the worker's connection (TCP or its
shared-memory pipe), in the learner's structure or the worker's `params_example`, whole
versions only while the learner publishes, compressed or raw, and samples going on around
the fetches."""

from __future__ import annotations

import struct
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
from testkit.net import HELLO_NOTICES, HELLO_PARAMS, HelloLeaf, ragged_dims, v2_handshake

import echo
from echo import Ragged

SHM = pytest.mark.skipif(sys.platform != "linux", reason="shared memory needs Linux")
PATHS = ["tcp", pytest.param("shm", marks=SHM)]


def example() -> dict[str, Any]:
    return {"tokens": Ragged(64, np.int32), "id": np.zeros((), np.int64)}


def make(i: int) -> dict[str, Any]:
    return {"tokens": np.arange(i % 65, dtype=np.int32) + i, "id": np.int64(i)}


def weights(step: int, n: int = 300_000) -> dict[str, Any]:
    """Every value is the step: a fetched version is whole when all of it agrees."""
    return {"policy": {"w": np.full(n, step, np.float32), "b": [np.full(3, step, np.int64)]}}


@pytest.mark.parametrize("path", PATHS)
def test_a_worker_fetches_whole_versions_while_it_sends_and_the_learner_publishes(
    path: str,
) -> None:
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    server = echo.Server(example(), batch_size=8, num_buffers=64, transport=transport)
    server.start()
    assert server.port is not None
    server.publish(weights(1))
    client = echo.TcpClient("127.0.0.1", server.port, example(), shared_memory=path == "shm")
    assert client.transport_path == path
    version, params = client.params(timeout=10)  # the learner's structure, from it
    assert version == 1
    assert params["policy"]["w"].shape == (300_000,)
    assert params["policy"]["b"][0].tolist() == [1, 1, 1]
    assert (client.policy_version, client.params_fetches) == (1, 1)
    stop = threading.Event()

    def publisher() -> None:
        step = 2
        while not stop.is_set() and step < 10_000:
            server.publish(weights(step), compress=echo.Lz4() if step % 2 else None)
            step += 1

    thread = threading.Thread(target=publisher)
    thread.start()
    try:
        seen = []
        for i in range(200):
            client.send(make(i))
            if i % 10 == 0:
                version, params = client.params(timeout=10)
                w, b = params["policy"]["w"], params["policy"]["b"][0]
                assert (w == version).all(), "a version is fetched whole, never torn"
                assert (b == version).all()
                seen.append(version)
        assert seen == sorted(seen)
        assert client.params_fetches == 21
        assert client.params_fetch_s > 0
    finally:
        stop.set()
        thread.join()
    client.wait(10)
    # Each publish is announced (from a thread of the learner's: the last one may be on
    # its way still).
    deadline = time.monotonic() + 10
    while client.params_version < server.params_version and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.params_version == server.params_version
    client.close()
    server.close(drain=True)
    ids = []
    while (s := server.sample(timeout=5)) is not None:
        ids.extend(s.batch["id"].tolist())
    assert ids == list(range(200)), "the samples went on around the fetches, in order"


def test_params_example_structure_min_version_and_a_wrong_size() -> None:
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    with echo.Server(example(), batch_size=4, transport=transport) as server:
        assert server.port is not None
        like = weights(0, n=10)
        client = echo.TcpClient("127.0.0.1", server.port, example(), params_example=like)
        with pytest.raises(TimeoutError, match=r"params\(\): no version of the parameters that"):
            client.params(timeout=0.1)  # nothing published yet
        server.publish(weights(7, n=10), version=7)
        with pytest.raises(TimeoutError, match=r"params\(\): no version of the parameters that"):
            client.params(min_version=8, timeout=0.1)
        version, params = client.params(min_version=7, timeout=10)
        assert version == 7
        assert params["policy"]["w"].tolist() == [7.0] * 10
        fetch = threading.Timer(0.1, lambda: server.publish(weights(9, n=10), version=9))
        fetch.start()
        version, _ = client.params(min_version=8, timeout=10)  # waits for the publish
        fetch.join()
        assert version == 9
        client.close()
        wrong = echo.TcpClient("127.0.0.1", server.port, example(),
                               params_example=weights(0, n=11))  # fmt: skip
        with pytest.raises(ValueError, match="publishes parameters of 64 bytes"):
            wrong.params(timeout=10)
        wrong.send(make(1))  # the connection goes on
        wrong.wait(10)
        wrong.close()


def test_a_restored_ragged_learner_serves_the_checkpointed_parameters(tmp_path: Any) -> None:
    """The checkpoint keeps the latest published version's parameters (with the learner's
    extra beside them): the restored learner publishes them again, a new worker fetches them
    bit for bit before any publish, and the next publish must have their leaves."""
    from echo import checkpoint as ckpt

    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    old = echo.Server(example(), batch_size=4, transport=transport, max_staleness=2)
    with old:
        old.publish(weights(1, n=1000))
        old.publish(weights(6, n=1000), version=6, compress=echo.Lz4())
        old.submit(make(3))
        old.checkpoint(tmp_path / "ckpt", extra={"step": 40})
    version, leaves = ckpt.read_params(tmp_path / "ckpt") or (0, {})
    assert version == 6
    assert list(leaves) == ["['policy']['b'][0]", "['policy']['w']"]
    assert leaves["['policy']['w']"].tolist() == [6.0] * 1000
    assert ckpt.read_extra(tmp_path / "ckpt") == {"step": 40}
    restored = echo.Server.restore(
        tmp_path / "ckpt", transport=echo.TcpTransport(port=0, host="127.0.0.1")
    )
    with restored as new:
        assert new.params_version == 6
        assert new.restored_extra == {"step": 40}
        assert new.stats().store_size == 1
        assert new.port is not None
        worker = echo.TcpClient("127.0.0.1", new.port, example())  # learns the structure
        version, got = worker.params(timeout=10)
        assert version == 6
        assert got["policy"]["w"].tolist() == [6.0] * 1000
        assert got["policy"]["b"][0].tolist() == [6, 6, 6]
        with pytest.raises(ValueError, match="restored from the checkpoint have 2"):
            new.publish({"policy": {"w": np.zeros(1000, np.float32)}})
        with pytest.raises(ValueError, match=r"leaf \['policy'\]\['w'\]: expected shape"):
            new.publish(weights(7, n=999))
        assert new.publish(weights(7, n=1000)) == 7
        version, got = worker.params(min_version=7, timeout=10)
        assert (version, got["policy"]["w"][0]) == (7, 7.0)
        # The restored learner's own checkpoints keep its latest version in turn.
        new.checkpoint(tmp_path / "again")
        worker.close()
    version, leaves = ckpt.read_params(tmp_path / "again") or (0, {})
    assert version == 7
    assert ckpt.read_extra(tmp_path / "again") is None
    assert leaves["['policy']['b'][0]"].tolist() == [7, 7, 7]


def test_periodic_ragged_checkpoints_keep_the_published_parameters(tmp_path: Any) -> None:
    from echo import checkpoint as ckpt
    from echo.checkpoint import periodic_checkpoints

    directory = tmp_path / "ckpts"
    with echo.Server(
        example(), batch_size=4, checkpoint_dir=directory, checkpoint_every=0.05
    ) as server:
        server.publish(weights(3, n=10), version=3)

        def newest() -> int:
            found = periodic_checkpoints(directory)
            params = ckpt.read_params(found[-1]) if found else None
            return 0 if params is None else params[0]

        deadline = time.monotonic() + 10
        while newest() != 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert newest() == 3
    with echo.Server.restore(periodic_checkpoints(directory)[-1]) as new:
        assert new.params_version == 3
        assert new.publish(weights(4, n=10)) == 4


def test_a_checkpoint_before_any_publish_restores_a_ragged_learner_without_parameters(
    tmp_path: Any,
) -> None:
    from echo import checkpoint as ckpt

    with echo.Server(example(), batch_size=4) as server:
        server.submit(make(5))
        server.checkpoint(tmp_path / "ckpt")
    assert ckpt.read_params(tmp_path / "ckpt") is None
    with echo.Server.restore(tmp_path / "ckpt") as new:
        assert new.params_version == 0
        assert new.publish(weights(1, n=12)) == 1  # any structure: none was fixed


@SHM
def test_a_worker_on_the_learners_host_copies_the_parameters_from_shared_memory() -> None:
    """A worker with a pipe was handed the learner's parameter region with it: its fetches
    copy a whole version from there (no chunk crosses its socket), one over TCP pulls chunks;
    both get the same bytes, and the next version after a publish."""
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    with echo.Server(example(), batch_size=4, transport=transport) as server:
        assert server.port is not None
        server.publish(weights(3), version=3)
        near = echo.TcpClient("127.0.0.1", server.port, example(), shared_memory=True)
        assert near.transport_path == "shm"
        version, got = near.params(timeout=10)
        assert version == 3
        assert got["policy"]["w"].tolist() == [3.0] * 300_000
        assert server.stats().params_chunks_served_total == 0, "copied, not sent"
        server.publish(weights(4))
        version, got = near.params(min_version=4, timeout=10)
        assert (version, float(got["policy"]["w"][-1])) == (4, 4.0)
        assert near.policy_version == 4
        assert server.stats().params_chunks_served_total == 0
        far = echo.TcpClient("127.0.0.1", server.port, example(), shared_memory=False)
        version, got = far.params(timeout=10)
        assert (version, float(got["policy"]["w"][0])) == (4, 4.0)
        stats = server.stats()
        assert stats.params_chunks_served_total >= 2  # 1.2 MB in chunks of 1 MiB
        assert stats.params_published_total == 2
        assert stats.params_version == 4
        near.close()
        far.close()


def test_a_worker_that_stops_reading_holds_up_no_other_workers_version_notices() -> None:
    """A peer that asks for parameter chunks and never reads them holds its connection's
    writes for up to the write timeout (10 s). The notices of new versions to the other
    workers do not wait for it: each hears of every version at once."""
    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    with echo.Server(example(), batch_size=4, transport=transport) as server:
        assert server.port is not None
        server.publish(weights(1, n=4_000_000), version=1)  # 16 MB
        leaves: list[HelloLeaf] = [
            ("['id']", b"<", b"i", 8, []),
            ("['tokens']", b"<", b"i", 4, ragged_dims(64, 1)),
        ]
        stalled = v2_handshake(server.port, leaves, HELLO_NOTICES | HELLO_PARAMS, rcvbuf=4096)
        chunk = 1 << 20
        stalled.sendall(
            b"".join(
                struct.pack("<BQQI", 0x32, 0, offset, chunk)
                for offset in range(0, 16 * chunk, chunk)
            )
        )
        deadline = time.monotonic() + 10
        while server.stats().params_chunks_served_total < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        # Its first chunk's write filled the buffers; the second waits behind it.
        assert server.stats().params_chunks_served_total >= 2
        worker = echo.TcpClient("127.0.0.1", server.port, example(), shared_memory=False)
        started = time.monotonic()
        for version in (2, 3, 4):
            server.publish(weights(version, n=4_000_000))
            deadline = time.monotonic() + 3
            while worker.params_version < version and time.monotonic() < deadline:
                time.sleep(0.005)
            assert worker.params_version == version, (version, time.monotonic() - started)
        worker.close()
        stalled.close()
