"""Durable acknowledgements: a worker with `durable=True` keeps each sample until a checkpoint
the learner completed holds it, so a learner SIGKILLed at any moment and restored from its
latest checkpoint ends with exactly the samples sent, none lost and none twice; the byte
budget blocks `send()` (counted) while a learner does not checkpoint; and the settings and
errors a user meets."""

from __future__ import annotations

import json
import random
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import test_wire_v2 as _wire_v2
from conftest import WAIT_S, poll
from test_wire_v2 import Child

from echo import Lifo, Sequence, Server, TcpClient, TcpTransport
from echo.checkpoint import periodic_checkpoints

LOCALHOST = "127.0.0.1"
EXAMPLE = {"id": np.zeros((), np.int64), "obs": np.zeros((16,), np.float32)}
ID_STRIDE = 1_000_000

#: The child-process fixture of the wire v2 tests: `children(name, argv)`, and their relay.
children = _wire_v2.children
proxy = _wire_v2.proxy


def sample(i: int) -> dict[str, np.ndarray]:
    return {"id": np.array(i, np.int64), "obs": np.full((16,), i % 9973, np.float32)}


# A learner process: a FIFO ring, a replay table or a sequence table (windows of one step)
# large enough that nothing is evicted,
# checkpointing every 0.1 s into the directory given, new or restored from its latest
# checkpoint, listening on 127.0.0.1 (or the host given after those). On "dump" it hands
# out every sample it holds (the replay table hands each out once: newest first,
# max_times_sampled=1) and prints their ids.
LEARNER = textwrap.dedent(
    """
    import signal, sys, threading, time
    import numpy as np
    import echo
    from echo.checkpoint import periodic_checkpoints

    signal.alarm(200)
    kind, port, directory, restore = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    host = sys.argv[5] if len(sys.argv) > 5 else "127.0.0.1"
    EXAMPLE = {"id": np.zeros((), np.int64), "obs": np.zeros((16,), np.float32)}
    settings = (
        {"num_buffers": 8192}
        if kind == "fifo"
        else {"sampler": echo.Lifo(), "max_size": 8192, "max_times_sampled": 1}
    )
    if kind == "sequence":  # windows of one step: each step is one item
        settings["sequence"] = echo.Sequence(1)
    transport = echo.TcpTransport(port=port, host=host)
    periodic = {"checkpoint_dir": directory, "checkpoint_every": 0.1, "checkpoint_keep": 3}
    if restore == "1":
        latest = periodic_checkpoints(directory)[-1]
        server = echo.Server.restore(latest, transport=transport, **periodic)
        print("restored", latest, server.stats().store_size, flush=True)
    else:
        server = echo.Server(EXAMPLE, 1, transport=transport, **settings, **periodic)
    server.start()
    print("port", server.port, flush=True)
    for line in sys.stdin:
        if line.strip() == "dump":
            break
    ids = []
    for _ in range(10**6):
        try:
            batch = server.sample(timeout=1.0)
        except TimeoutError:
            break
        if batch is None:
            break
        i = int(batch.batch["id"].ravel()[0])
        assert (batch.batch["obs"].ravel() == np.float32(i % 9973)).all(), i
        ids.append(i)
    print("ids", " ".join(map(str, ids)), flush=True)
    print("done", flush=True)
    """
)

# A durable worker: sends `n` samples with ids `w * ID_STRIDE + i`, pacing itself, then
# closes (which waits until everything is persisted) and prints its counters. Arguments:
# port, w, n, durable_bytes, "tcp" or "shm", and the learner's host (127.0.0.1).
WORKER = textwrap.dedent(
    """
    import json, signal, sys, time
    import numpy as np
    import echo

    signal.alarm(200)
    port, w, n, budget = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    host = sys.argv[6] if len(sys.argv) > 6 else "127.0.0.1"
    client = echo.TcpClient(
        host, port, {"id": np.zeros((), np.int64), "obs": np.zeros((16,), np.float32)},
        durable=True, durable_bytes=budget, reconnect_timeout=60.0,
        heartbeat_timeout=2.0, name=f"worker-{w}", shared_memory=sys.argv[5] == "shm",
    )
    print("connected", client.transport_path, flush=True)
    for i in range(n):
        j = w * 1_000_000 + i
        client.send({"id": np.array(j, np.int64), "obs": np.full((16,), j % 9973, np.float32)},
                    timeout=60.0)
        if i % 20 == 0:
            time.sleep(0.01)
    closed = client.close(timeout=60.0)
    print("result", json.dumps({
        "closed_at": time.time(),  # when everything was persisted and the worker closed
        "closed": closed, "sent": client.sent, "persisted": client.persisted,
        "reconnects": client.reconnects, "resent": client.resent,
        "waits": client.durable_waits, "given_up": client.given_up,
    }), flush=True)
    """
)


def assert_cut_off(results: list[dict[str, Any]], killed_at: float) -> None:
    """The kill fell mid-stream: every worker that had not closed by then (all its samples
    persisted; on a loaded machine one may finish first) was cut off and came back, and at
    least one had not."""
    open_at_kill = [r for r in results if r["closed_at"] > killed_at]
    assert open_at_kill, f"every worker closed before the kill: {results}"
    assert all(r["reconnects"] >= 1 for r in open_at_kill), results


def dumped_ids(learner: Child) -> list[int]:
    """The ids a `LEARNER` printed after "dump"."""
    line = learner.expect("ids", 3 * WAIT_S)
    return [int(x) for x in line.split()[1:]]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["fifo", "replay", "sequence"])
@pytest.mark.parametrize("path", ["tcp", "shm"])
def test_a_learner_killed_at_a_random_moment_and_restored_ends_with_every_sample_once(
    children: Callable[..., Child], tmp_path: Any, kind: str, path: str
) -> None:
    """4 durable worker processes send 2,000 samples each (a 16 KiB budget: about 220
    samples not yet persisted at most) to a learner that checkpoints every 0.1 s. It is
    SIGKILLed at a random moment and restored from its latest checkpoint on the same port:
    the restored learner holds every sample of every worker exactly once, intact: a FIFO
    ring, a replay table, a sequence table (windows of one step, so each step is an item).
    Over TCP, and over same-host shared memory (the restored learner offers a new segment)."""
    rng = random.Random(20261206 + len(kind))
    num_workers, n, budget = 4, 2000, 16384
    directory = tmp_path / "ckpt"
    args = [sys.executable, "-c", LEARNER, kind]
    old = children("learner-old", [*args, "0", str(directory), "0"], stdin=True)
    port = int(old.expect("port ").split()[1])
    worker = [sys.executable, "-c", WORKER, str(port)]
    workers = [
        children(f"worker-{w}", [*worker, str(w), str(n), str(budget), path])
        for w in range(num_workers)
    ]
    for worker in workers:
        assert worker.expect("connected").split()[1] == path
    time.sleep(rng.uniform(0.2, 0.8))  # sending 2,000 takes each worker over 1 s
    poll(lambda: periodic_checkpoints(directory), bool, "a first checkpoint")
    killed_at = time.time()
    old.kill()
    new = children("learner-new", [*args, str(port), str(directory), "1"], stdin=True)
    new.expect("restored")
    assert int(new.expect("port ").split()[1]) == port
    results = [json.loads(wk.expect("result ", 120).split(" ", 1)[1]) for wk in workers]
    new.send_line("dump")
    ids = dumped_ids(new)
    expected = sorted(w * ID_STRIDE + i for w in range(num_workers) for i in range(n))
    assert len(ids) == len(set(ids)), "a sample twice"
    missing = sorted(set(expected) - set(ids))
    assert sorted(ids) == expected, f"{len(missing)} lost, e.g. {missing[:5]}"
    for result in results:
        assert result["closed"], result
        assert (result["sent"], result["persisted"], result["given_up"]) == (n, n, 0), result
    # Killed mid-stream: every worker was cut off and came back (what each resent depends on
    # where the kill fell against the checkpoints; the in-process test below checks a count).
    assert_cut_off(results, killed_at)


@pytest.mark.parametrize("path", ["tcp", "shm"])
def test_send_blocks_on_the_byte_budget_until_a_checkpoint_persists_what_it_keeps(
    tmp_path: Any, path: str
) -> None:
    """Without checkpoints nothing is persisted: a 1 KiB budget holds 14 samples (1 + 8 + 64
    bytes each with the frame header), the next `send()` times out and is counted, and a
    checkpoint lets it through and tells the client how far its samples are persisted."""
    server = Server(EXAMPLE, 1, num_buffers=64, transport=TcpTransport(port=0, host=LOCALHOST))
    with server:
        client = TcpClient(
            LOCALHOST,
            server.port,
            EXAMPLE,
            durable=True,
            durable_bytes=1024,
            shared_memory=path == "shm",
        )
        assert client.durable
        assert client.transport_path == path
        frame = 1 + 8 + 16 * 4
        fits = 1024 // frame
        for i in range(fits):
            client.send(sample(i), timeout=WAIT_S)
        client.wait(timeout=WAIT_S)
        assert (client.acked, client.persisted, client.retained_bytes) == (fits, 0, fits * frame)
        with pytest.raises(TimeoutError):
            client.send(sample(fits), timeout=0.2)
        assert client.durable_waits == 1
        # The wait is timed from when it starts, inside the call whose 0.2 s deadline began a
        # moment before (the sample's conversion, the window's check).
        assert 0.18 <= client.durable_wait_s <= 0.2 + 0.05
        assert client.sent == fits  # the timed-out sample was not sent
        server.checkpoint(tmp_path / "one")
        client.send(sample(fits), timeout=WAIT_S)
        poll(lambda: client.persisted, lambda p: p == fits, "the persisted notice")
        assert client.retained_bytes == frame
        with pytest.raises(TimeoutError):
            client.wait_persisted(timeout=0.2)
        server.checkpoint(tmp_path / "two")
        client.wait_persisted(timeout=WAIT_S)
        assert (client.persisted, client.retained_bytes) == (fits + 1, 0)
        assert client.close(timeout=WAIT_S)
        got = [int(server.sample(timeout=WAIT_S).batch["id"][0]) for _ in range(fits + 1)]
        assert got == list(range(fits + 1))


def test_a_restored_learner_tells_a_durable_client_where_its_checkpoint_stands(
    tmp_path: Any,
) -> None:
    """In one process: 50 samples, a checkpoint, 30 more; the learner closes (restarting)
    and is restored from the checkpoint on the same port. The client resends exactly the 30
    the checkpoint does not hold, though the closed learner had acknowledged them."""
    server = Server(EXAMPLE, 1, num_buffers=256, transport=TcpTransport(port=0, host=LOCALHOST))
    server.start()
    port = server.port
    client = TcpClient(
        LOCALHOST, port, EXAMPLE, durable=True, reconnect_timeout=WAIT_S, heartbeat_timeout=1.0
    )
    for i in range(50):
        client.send(sample(i), timeout=WAIT_S)
    client.wait(timeout=WAIT_S)
    server.checkpoint(tmp_path / "c")
    poll(lambda: client.persisted, lambda p: p == 50, "the persisted notice")
    for i in range(50, 80):
        client.send(sample(i), timeout=WAIT_S)
    client.wait(timeout=WAIT_S)
    assert client.persisted == 50
    server.close(restarting=True)
    # The client has heard the learner go before it sends more: the next send reconnects
    # first (else those samples would go to the dead connection, and be resent too).
    poll(lambda: client.server_closing, lambda why: why == "restarting", "the closing notice")
    restored = Server.restore(tmp_path / "c", transport=TcpTransport(port=port, host=LOCALHOST))
    with restored:
        for i in range(80, 90):
            client.send(sample(i), timeout=WAIT_S)
        client.wait(timeout=WAIT_S)
        assert (client.reconnects, client.resent, client.resumed_from) == (1, 30, 50)
        got = [int(restored.sample(timeout=WAIT_S).batch["id"][0]) for _ in range(90)]
        assert got == list(range(90))
        restored.checkpoint(tmp_path / "d")
        client.wait_persisted(timeout=WAIT_S)
        assert client.persisted == 90
        assert client.close(timeout=WAIT_S)


def test_durable_settings_are_checked() -> None:
    with pytest.raises(TypeError, match="durable"):
        TcpClient(LOCALHOST, 1, EXAMPLE, durable="yes")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="durable_bytes"):
        TcpClient(LOCALHOST, 1, EXAMPLE, durable=True, durable_bytes=0)


def test_durable_needs_protocol_2() -> None:
    """Durable acknowledgements need wire protocol 2 (id-echo 0.2.1's protocol 1 has no
    sessions): refused before connecting, with the reason."""
    with pytest.raises(ValueError, match="needs protocol 2"):
        TcpClient(LOCALHOST, 1, EXAMPLE, durable=True, protocol=1)


def test_a_sequence_table_restored_gets_every_step_of_a_durable_worker_once(
    tmp_path: Any,
) -> None:
    """Steps to a sequence table (windows of one step, so each step is one item), episodes of
    10: 55 steps, a checkpoint, 25 more, a restart from the checkpoint, 20 more. The restored
    table holds steps 0..99 once each: the 25 acknowledged after the checkpoint are resent."""
    transport = TcpTransport(port=0, host=LOCALHOST)
    settings = {"sampler": Lifo(), "max_size": 1000, "max_times_sampled": 1}
    server = Server(EXAMPLE, 1, sequence=Sequence(1), transport=transport, **settings)
    server.start()
    port = server.port
    client = TcpClient(LOCALHOST, port, EXAMPLE, durable=True, reconnect_timeout=WAIT_S)
    assert client.sequence_rows is not None

    def steps(first: int, last: int) -> None:
        for i in range(first, last):
            client.send(sample(i), end_episode=i % 10 == 9, timeout=WAIT_S)
        client.wait(timeout=WAIT_S)

    steps(0, 55)
    poll(lambda: server.stats().store_size, lambda n: n == 55, "55 windows")
    server.checkpoint(tmp_path / "s")
    steps(55, 80)
    poll(lambda: client.persisted, lambda p: p == 55, "the persisted notice")
    server.close(restarting=True)
    restored = Server.restore(tmp_path / "s", transport=TcpTransport(port=port, host=LOCALHOST))
    with restored:
        steps(80, 100)
        assert (client.resent, client.resumed_from) == (25, 55)
        poll(lambda: restored.stats().store_size, lambda n: n == 100, "100 windows")
        got = sorted(int(restored.sample(timeout=WAIT_S).batch["id"][0, 0]) for _ in range(100))
        assert got == list(range(100))
        restored.checkpoint(tmp_path / "t")
        assert client.close(timeout=WAIT_S)


def test_a_durable_session_resumes_through_dropped_connections_before_any_checkpoint(
    tmp_path: Any, proxy: Callable[..., Any]
) -> None:
    """A relay in front of the learner resets the connection twice while nothing is
    persisted: each reconnect claims sample 0 (the client's persisted mark), the session
    resumes where it stands (20, then 40: every acknowledged sample counts as deduplicated),
    nothing is stored twice, and a checkpoint then persists all 60."""
    server = Server(EXAMPLE, 1, num_buffers=128, transport=TcpTransport(port=0, host=LOCALHOST))
    with server:
        relay = proxy(server.port)
        client = TcpClient(
            LOCALHOST,
            relay.port,
            EXAMPLE,
            durable=True,
            reconnect_timeout=WAIT_S,
            shared_memory=False,
        )
        for round_ in range(3):
            for i in range(20 * round_, 20 * round_ + 20):
                client.send(sample(i), timeout=WAIT_S)
            client.wait(timeout=WAIT_S)
            if round_ < 2:
                relay.command("drop")
        # The session resumed where it stood (what the client wrote into a connection already
        # reset before it noticed is resent: a number that depends on that timing).
        assert (client.reconnects, client.resumed_from, client.persisted) == (2, 40, 0)
        server.checkpoint(tmp_path / "c")
        client.wait_persisted(timeout=WAIT_S)
        assert (client.persisted, client.retained_bytes) == (60, 0)
        got = [int(server.sample(timeout=WAIT_S).batch["id"][0]) for _ in range(60)]
        assert got == list(range(60))
        stats = server.stats()
        assert (stats.sessions_resumed_total, stats.samples_deduplicated_total) == (2, 60)
        assert client.close(timeout=WAIT_S)


def test_large_samples_read_straight_into_the_ring_are_counted_in_the_checkpoint_mark(
    tmp_path: Any,
) -> None:
    """64 KiB samples to a FIFO ring over TCP are read from the socket straight into ring
    slots (not through the ingress queue); the checkpoint's mark counts them all the same:
    40 samples, a checkpoint (its mark: 40), 30 more, a restore (resumed at 40), and the
    restored ring holds every sample once."""
    big = {"id": np.zeros((), np.int64), "obs": np.zeros((16384,), np.float32)}

    def large(i: int) -> dict[str, np.ndarray]:
        return {"id": np.array(i, np.int64), "obs": np.full((16384,), i, np.float32)}

    transport = TcpTransport(port=0, host=LOCALHOST)
    server = Server(big, 1, num_buffers=512, transport=transport)
    server.start()
    port = server.port
    client = TcpClient(
        LOCALHOST, port, big, durable=True, reconnect_timeout=WAIT_S, shared_memory=False
    )
    for i in range(40):
        client.send(large(i), timeout=WAIT_S)
    client.wait(timeout=WAIT_S)
    assert server.stats().samples_received_in_place_total > 0
    server.checkpoint(tmp_path / "c")
    for i in range(40, 70):
        client.send(large(i), timeout=WAIT_S)
    client.wait(timeout=WAIT_S)
    mark = client.persisted
    assert mark == 40
    server.close(restarting=True)
    restored = Server.restore(tmp_path / "c", transport=TcpTransport(port=port, host=LOCALHOST))
    with restored:
        for i in range(70, 80):
            client.send(large(i), timeout=WAIT_S)
        client.wait(timeout=WAIT_S)
        assert client.resumed_from == 40
        got = []
        for _ in range(80):
            batch = restored.sample(timeout=WAIT_S).batch
            i = int(batch["id"][0])
            assert (batch["obs"][0] == np.float32(i)).all()
            got.append(i)
        assert got == list(range(80))
        restored.checkpoint(tmp_path / "d")
        assert client.close(timeout=WAIT_S)


def test_close_without_a_checkpoint_gives_up_what_is_not_persisted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A learner that never checkpoints: `close()` waits its timeout for persistence, returns
    False, and `given_up` counts every sample (all acknowledged, none persisted)."""
    server = Server(EXAMPLE, 1, num_buffers=64, transport=TcpTransport(port=0, host=LOCALHOST))
    with server:
        client = TcpClient(LOCALHOST, server.port, EXAMPLE, durable=True)
        for i in range(12):
            client.send(sample(i), timeout=WAIT_S)
        client.wait(timeout=WAIT_S)
        with caplog.at_level("INFO", logger="echo"):
            assert client.close(timeout=0.2) is False
        assert (client.acked, client.persisted, client.given_up) == (12, 0, 12)
        assert "closed with 12 samples not persisted (given up)" in caplog.text
