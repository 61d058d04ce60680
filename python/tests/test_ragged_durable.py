"""Durable ragged workers: every frame kept until a checkpoint the learner completed holds
it, so a learner restored from its latest checkpoint ends with exactly the samples sent
(none lost, none twice), over TCP and shared memory; the byte budget of what is kept."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_wire_v2 as _wire_v2
from conftest import poll
from test_durable import assert_cut_off
from test_wire_v2 import Child

import echo
from echo import Ragged
from echo.checkpoint import periodic_checkpoints

#: The child-process fixture of the wire v2 tests: `children(name, argv)`.
children = _wire_v2.children

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


# A ragged learner process: a FIFO table (batches of 4) large enough for every sample,
# checkpointing every 0.1 s into the directory given, new or restored from its latest
# checkpoint. On "dump" it hands out every sample it holds, checks each, and prints the ids.
LEARNER = textwrap.dedent(
    """
    import signal, sys
    import numpy as np
    import echo
    from echo.checkpoint import periodic_checkpoints

    signal.alarm(200)
    port, directory, restore = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    EXAMPLE = {
        "tokens": echo.Ragged(200, np.int32, group="completion"),
        "logp": echo.Ragged(200, np.float32, group="completion"),
        "id": np.zeros((), np.int64),
    }
    transport = echo.TcpTransport(port=port, host="127.0.0.1")
    periodic = {"checkpoint_dir": directory, "checkpoint_every": 0.1, "checkpoint_keep": 3}
    if restore == "1":
        latest = periodic_checkpoints(directory)[-1]
        server = echo.Server.restore(latest, EXAMPLE, transport=transport, **periodic)
        print("restored", latest, server.stats().store_size, flush=True)
    else:
        server = echo.Server(EXAMPLE, 4, transport, num_buffers=5_000, **periodic)
    server.start()
    print("port", server.port, flush=True)
    for line in sys.stdin:
        if line.strip() == "dump":
            break
    ids = []
    server.close(drain=True)
    while (batch := server.sample(timeout=5)) is not None:
        tokens = batch.batch["tokens"]
        rows = np.split(tokens.values, tokens.cu_seqlens[1:-1])
        for i, got in zip(batch.batch["id"].tolist(), rows, strict=True):
            assert np.array_equal(got, np.arange((i * 37) % 201, dtype=np.int32) + i), i
            ids.append(i)
    print("ids", " ".join(map(str, ids)), flush=True)
    """
)

# A durable ragged worker: sends `n` samples with ids `w * 1,000,000 + i` (every fifth pair
# as a group), pacing itself, then closes (which waits until everything is persisted) and
# prints its counters. Arguments: port, w, n, durable_bytes, "tcp" or "shm".
WORKER = textwrap.dedent(
    """
    import json, signal, sys, time
    import numpy as np
    import echo

    signal.alarm(200)
    port, w, n, budget = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    example = {
        "tokens": echo.Ragged(200, np.int32, group="completion"),
        "logp": echo.Ragged(200, np.float32, group="completion"),
        "id": np.zeros((), np.int64),
    }
    client = echo.TcpClient("127.0.0.1", port, example, durable=True, durable_bytes=budget,
                            reconnect_timeout=60.0, shared_memory=sys.argv[5] == "shm")
    print("connected", client.transport_path, flush=True)

    def make(i):
        n = (i * 37) % 201
        return {"tokens": np.arange(n, dtype=np.int32) + i,
                "logp": np.full(n, -float(i), np.float32), "id": np.int64(i)}

    i = 0
    while i < n:
        j = w * 1_000_000 + i
        if i % 10 == 0 and i + 1 < n:
            client.send_group([make(j), make(j + 1)], timeout=60.0)
            i += 2
        else:
            client.send(make(j), timeout=60.0)
            i += 1
        if i % 20 == 0:
            time.sleep(0.01)
    closed = client.close(timeout=60.0)
    print("result", json.dumps({
        "closed_at": time.time(), "closed": closed, "sent": client.sent,
        "persisted": client.persisted, "reconnects": client.reconnects,
        "given_up": client.given_up,
    }), flush=True)
    """
)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", PATHS)
def test_a_learner_killed_at_a_random_moment_ends_with_every_sample_once(
    children: Callable[..., Child], tmp_path: Path, path: str
) -> None:
    """3 durable worker processes send 1,500 rollouts each (groups among them; a 64 KiB
    budget) to a learner process that checkpoints every 0.1 s. It is SIGKILLed at a random
    moment and a new process restores its latest checkpoint on the same port: the restored
    learner holds every rollout of every worker exactly once, intact."""
    rng = random.Random(20261207 + len(path))
    num_workers, n, budget = 3, 1500, 65536
    directory = tmp_path / "ckpt"
    old = children("learner-old", [sys.executable, "-c", LEARNER, "0", str(directory), "0"],
                   stdin=True)  # fmt: skip
    port = int(old.expect("port ").split()[1])
    workers = [
        children(f"worker-{w}",
                 [sys.executable, "-c", WORKER, str(port), str(w), str(n), str(budget), path])
        for w in range(num_workers)
    ]  # fmt: skip
    for worker in workers:
        assert worker.expect("connected").split()[1] == path
    time.sleep(rng.uniform(0.2, 0.6))
    poll(lambda: periodic_checkpoints(directory), bool, "a first checkpoint")
    killed_at = time.time()
    old.kill()
    new = children("learner-new", [sys.executable, "-c", LEARNER, str(port), str(directory), "1"],
                   stdin=True)  # fmt: skip
    new.expect("restored")
    results = [json.loads(wk.expect("result ", 120).split(" ", 1)[1]) for wk in workers]
    new.send_line("dump")
    ids = [int(x) for x in new.expect("ids", 60).split()[1:]]
    expected = sorted(w * 1_000_000 + i for w in range(num_workers) for i in range(n))
    assert len(ids) == len(set(ids)), "a rollout twice"
    missing = sorted(set(expected) - set(ids))
    assert sorted(ids) == expected, f"{len(missing)} lost, e.g. {missing[:5]}"
    for result in results:
        assert result["closed"], result
        assert (result["sent"], result["persisted"], result["given_up"]) == (n, n, 0), result
    assert_cut_off(results, killed_at)


# A learner whose periodic checkpoints (every 10 ms, a worker connected) run while its main
# thread reads stats() and the port without pause: a lock the checkpoint thread held while it
# waited for the GIL, and the main thread waited for with the GIL, hung both (in a child
# process: a hang there cannot hang the tests).
STATS_WHILE_CHECKPOINTING = textwrap.dedent(
    """
    import sys, tempfile, time
    import numpy as np
    import echo

    example = {"tokens": echo.Ragged(16, np.int32), "id": np.zeros((), np.int64)}
    with tempfile.TemporaryDirectory() as directory:
        server = echo.Server(example, 4, echo.TcpTransport(port=0, host="127.0.0.1"),
                             sampler=echo.Uniform(), max_size=1000,
                             checkpoint_dir=directory, checkpoint_every=0.01)
        server.start()
        client = echo.TcpClient("127.0.0.1", server.port, example, durable=True)
        end = time.monotonic() + 1.5
        i = 0
        while time.monotonic() < end:
            client.send({"tokens": np.arange(i % 16, dtype=np.int32), "id": np.int64(i)})
            i += 1
            for _ in range(20):
                server.stats()
                assert server.port
        client.close(timeout=10)
        server.close()
    print("ok", i, flush=True)
    """
)


def test_stats_while_periodic_checkpoints_tell_durable_workers() -> None:
    done = subprocess.run(
        [sys.executable, "-c", STATS_WHILE_CHECKPOINTING],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok"), done.stdout


def test_a_durable_worker_keeps_what_a_blip_left_unpersisted_for_a_restored_learner(
    tmp_path: Path,
) -> None:
    """A connection cut while the learner is up: the worker reconnects to the same learner,
    which has stored frames no checkpoint holds yet. The worker keeps them (resending none):
    when the learner then dies and is restored from its checkpoint, they are resent, and
    the restored learner ends with every sample once."""
    from test_ragged_tcp import _CuttingProxy

    transport = echo.TcpTransport(port=0, host="127.0.0.1")
    learner = echo.Server(example(), 8, transport=transport, sampler=echo.Uniform(), max_size=1000)
    learner.start()
    port = learner.port
    assert port is not None
    proxy = _CuttingProxy(port, cuts=0, after=0)
    worker = echo.TcpClient(
        "127.0.0.1", proxy.port, example(), shared_memory=False, durable=True,
        reconnect_timeout=30,
    )  # fmt: skip
    restored = None
    try:
        for i in range(40):
            worker.send(make(i), timeout=10)
        worker.wait(10)
        learner.checkpoint(tmp_path / "ckpt")
        worker.wait_persisted(10)
        for i in range(40, 80):
            worker.send(make(i), timeout=10)
        worker.wait(10)  # stored and acknowledged, in no checkpoint
        kept = worker.retained_bytes
        proxy.cut_now()
        worker.send(make(80), timeout=10)
        worker.wait(10)  # on a new connection to the same learner
        assert worker.resumed_from == 80
        assert worker.retained_bytes > kept, "what no checkpoint holds is still kept"
        assert learner.stats().store_size == 81  # none resent twice
        learner.close(restarting=True)
        again = echo.TcpTransport(port=port, host="127.0.0.1")
        restored = echo.Server.restore(tmp_path / "ckpt", example(), transport=again)
        restored.start()
        worker.send(make(81), timeout=10)
        worker.wait(10)
        assert worker.resumed_from == 40
        restored.checkpoint(tmp_path / "again")
        assert worker.close(timeout=10), "every sample persisted"
        assert sorted(ids_of(restored)) == list(range(82))
    finally:
        proxy.close()
        learner.close()
        if restored is not None:
            restored.close()
