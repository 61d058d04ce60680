"""Checkpoints of FIFO servers and of the ingress's acknowledged samples (issue #13): contents
and order after a restore, consistency under concurrent producers (threads and TCP clients)
and a consumer, queued samples, SIGKILL mid-checkpoint, and damaged checkpoints.

What "consistent" means here. A checkpoint is the server's state at one moment `T`: every
sample acknowledged (or `submit()`ed) before `T` was either handed to the learner before `T`
or is in the checkpoint, exactly once; nothing else is. So, with `H` the manifest's
`handed_out_before` and `R` everything the learner received, in order:
- every row is a whole sample (no torn or mixed bytes) and no row appears twice;
- no row is among the first `H` samples the learner got (`R[:H]`), and the ring's rows are
  exactly the samples the learner gets next (`R[H:H + from_ring]`, as far as it got);
- for every producer, `R[:H]` and the checkpoint together hold a prefix of what it sent
  (sequence numbers 0..m, no gap), and the checkpoint holds that producer's samples in the
  order it sent them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from testkit.checkpoints import example, intact_ids, item, kill_mid_checkpoint

from echo import (
    CheckpointError,
    Queue,
    Server,
    TcpClient,
    TcpTransport,
    Uniform,
)

LOCALHOST = "127.0.0.1"
WAIT_S = 10.0
PAIRS_0_TO_9 = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]  # samples 0..9 in batches of 2


def checkpoint_rows(path: Path) -> tuple[list[int], dict[str, Any]]:
    """The ids of a FIFO checkpoint's rows, in order (each checked whole), and its counts."""
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "echo-fifo-checkpoint"
    files = {leaf["name"]: leaf["file"] for leaf in manifest["layout"]["leaves"]}
    load = lambda name: np.load(path / files[name], mmap_mode="r")  # noqa: E731
    ids = intact_ids(load("['obs']"), load("['extra']['id']"), load("['extra']['blob']"))
    counts = manifest["counts"]
    assert counts["items"] == len(ids) == counts["from_ring"] + counts["from_ingress"]
    return ids, counts


def batch_ids(sample: Any) -> list[int]:
    b = sample.batch
    return intact_ids(b["obs"], b["extra"]["id"], b["extra"]["blob"])


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def test_restore_reproduces_the_fifo_contents_and_order(tmp_path: Path) -> None:
    with Server(example(), 4, num_buffers=3) as server:
        for i in range(10):
            server.submit(item(i))
        first = server.sample(timeout=WAIT_S)
        assert first is not None
        assert batch_ids(first) == [0, 1, 2, 3]
        server.checkpoint(tmp_path / "c")
        ids, counts = checkpoint_rows(tmp_path / "c")
        # The held batch was handed out; 8 and 9 are a partial batch.
        assert ids == list(range(4, 10))
        assert counts == {"items": 6, "from_ring": 6, "from_ingress": 0, "handed_out_before": 4}
        # The original goes on as if nothing happened.
        server.submit(item(10))
        server.submit(item(11))
        assert batch_ids(server.sample(timeout=WAIT_S)) == [4, 5, 6, 7]
    restored = Server.restore(tmp_path / "c")
    with restored:
        assert (restored.batch_size, restored.num_buffers) == (4, 3)
        assert restored.stats().store_size == 6
        restored.submit(item(100))
        restored.submit(item(101))
        got = [batch_ids(restored.sample(timeout=WAIT_S)) for _ in range(2)]
        assert got == [[4, 5, 6, 7], [8, 9, 100, 101]]
        # A checkpoint of the restored server holds what the original's would.
        restored.checkpoint(tmp_path / "again")
    assert checkpoint_rows(tmp_path / "again")[0] == []


def test_an_empty_and_a_full_ring_round_trip(tmp_path: Path) -> None:
    with Server(example(), 2, num_buffers=2) as server:
        server.checkpoint(tmp_path / "empty")
        for i in range(4):
            server.submit(item(i))
        server.checkpoint(tmp_path / "full")
    assert checkpoint_rows(tmp_path / "empty")[0] == []
    assert checkpoint_rows(tmp_path / "full")[0] == [0, 1, 2, 3]
    with Server.restore(tmp_path / "full") as restored:
        assert [batch_ids(restored.sample(timeout=WAIT_S)) for _ in range(2)] == [[0, 1], [2, 3]]


def tcp_server(tmp_path: Path, **kwargs: Any) -> Server:
    server = Server(
        example(), 2, transport=TcpTransport(port=0, host=LOCALHOST), num_buffers=2, **kwargs
    )
    server.start()
    return server


def test_acknowledged_samples_queued_in_the_ingress_are_in_a_fifo_checkpoint(
    tmp_path: Path,
) -> None:
    # A ring of 4 and no consumer: the first 4 fill it, the other 6 stay in the ingress
    # (acknowledged, in a drainer's round or the connection's queue) however long we wait.
    server = tcp_server(tmp_path, producer_queue_size=8)
    try:
        # Over TCP, whose ingress queue holds acknowledged samples (over shared memory they
        # wait in the worker's segment, unacknowledged: see the test after this one).
        client = TcpClient(
            LOCALHOST, server.port, example(), max_inflight_msgs=32, shared_memory=False
        )
        for i in range(10):
            client.send(item(i))
        client.wait()  # every one acknowledged
        wait_until(lambda: server.stats().store_size == 4, "a full ring")
        server.checkpoint(tmp_path / "q")
        ids, counts = checkpoint_rows(tmp_path / "q")
        assert ids == list(range(10))
        assert (counts["from_ring"], counts["from_ingress"]) == (4, 6)
        # They are still queued: the server hands them out in order.
        assert [batch_ids(server.sample(timeout=WAIT_S)) for _ in range(5)] == PAIRS_0_TO_9
        client.close()
    finally:
        server.close()
    restored = Server.restore(tmp_path / "q")
    with restored:
        # More than the ring holds: the rest goes in as room frees, before anything new.
        late: list[BaseException] = []

        def submit_new() -> None:
            try:
                restored.submit(item(100), timeout=WAIT_S)
                restored.submit(item(101), timeout=WAIT_S)
            except BaseException as e:  # noqa: BLE001 -- reported by the test
                late.append(e)

        t = threading.Thread(target=submit_new)
        t.start()
        got = [batch_ids(restored.sample(timeout=WAIT_S)) for _ in range(6)]
        t.join(WAIT_S)
        assert not late, late
        assert got == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [100, 101]]


def test_samples_waiting_in_a_shared_memory_segment_are_not_acknowledged(
    tmp_path: Path,
) -> None:
    # The same ring of 4 and 10 samples, from a same-host client over shared memory: what
    # the ring cannot take waits in the client's segment, unacknowledged (the client still
    # holds it to flush), so a checkpoint has the ring's 4 and nothing from the ingress, and
    # the rest goes in, in order, as the consumer frees room.
    server = tcp_server(tmp_path, producer_queue_size=8)
    try:
        client = TcpClient(LOCALHOST, server.port, example(), shared_memory=True)
        for i in range(10):
            client.send(item(i))
        with pytest.raises(TimeoutError):
            client.wait(timeout=0.5)
        assert client.acked == 4
        server.checkpoint(tmp_path / "s")
        ids, counts = checkpoint_rows(tmp_path / "s")
        assert ids == [0, 1, 2, 3]
        assert (counts["from_ring"], counts["from_ingress"]) == (4, 0)
        assert [batch_ids(server.sample(timeout=WAIT_S)) for _ in range(5)] == PAIRS_0_TO_9
        assert client.close(timeout=WAIT_S)
    finally:
        server.close()


def test_acknowledged_samples_queued_in_the_ingress_are_in_a_replay_checkpoint(
    tmp_path: Path,
) -> None:
    # Queue(4): inserts wait once 4 items are unsampled, so 6 stay in the ingress.
    server = Server(
        example(),
        2,
        transport=TcpTransport(port=0, host=LOCALHOST),
        sampler=Uniform(),
        max_size=8,
        rate_limiter=Queue(4),
        max_times_sampled=1,
        seed=5,
    )
    server.start()
    try:
        client = TcpClient(
            LOCALHOST, server.port, example(), max_inflight_msgs=32, shared_memory=False
        )
        for i in range(10):
            client.send(item(i))
        client.wait()
        wait_until(lambda: server.stats().store_size == 4, "a full queue")
        server.checkpoint(tmp_path / "r")
        client.close()
    finally:
        server.close()
    path = tmp_path / "r"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["counts"] == {"items": 4, "from_ingress": 6}
    items = intact_ids(
        np.load(path / "leaf_002.npy"),
        np.load(path / "leaf_001.npy"),
        np.load(path / "leaf_000.npy"),
    )
    queued = intact_ids(
        np.load(path / "ingress_leaf_002.npy"),
        np.load(path / "ingress_leaf_001.npy"),
        np.load(path / "ingress_leaf_000.npy"),
    )
    assert (items, queued) == ([0, 1, 2, 3], [4, 5, 6, 7, 8, 9])
    assert np.isnan(np.load(path / "ingress_priorities.npy")).all(), "sent without one"
    restored = Server.restore(path)
    with restored:
        done = threading.Event()

        def submit_new() -> None:
            restored.submit(item(100), timeout=WAIT_S)
            restored.submit(item(101), timeout=WAIT_S)
            done.set()

        t = threading.Thread(target=submit_new)
        t.start()
        by_key: dict[int, int] = {}
        for _ in range(6):
            sample = restored.sample(timeout=WAIT_S)
            assert sample is not None
            assert sample.keys is not None
            by_key.update(zip((int(k) for k in sample.keys), batch_ids(sample), strict=True))
        t.join(WAIT_S)
        assert done.is_set()
    # Keys number items in insertion order: the queued ones went in before the new ones.
    assert [by_key[k] for k in sorted(by_key)] == [*range(10), 100, 101]


def check_consistent(
    ids: list[int], counts: dict[str, Any], received: list[int], producers: list[int]
) -> None:
    """The checkpoint rows `ids` against what the learner received (see the module doc)."""
    assert len(set(ids)) == len(ids), "a sample twice in the checkpoint"
    handed = counts["handed_out_before"]
    assert len(received) >= handed, "the learner got at least what it had been handed"
    before = received[:handed]
    assert not set(before) & set(ids), "a sample handed out before the checkpoint is in it"
    ring = ids[: counts["from_ring"]]
    after = received[handed : handed + len(ring)]
    assert ring[: len(after)] == after, "the ring's rows are what the learner got next"
    for p in producers:
        mine = [i & 0xFFFFFFFF for i in ids if i >> 32 == p]
        assert mine == sorted(mine), f"producer {p}: out of order in the checkpoint"
        seen = sorted([i & 0xFFFFFFFF for i in before if i >> 32 == p] + mine)
        assert seen == list(range(len(seen))), f"producer {p}: a gap (lost sample)"


def test_a_fifo_checkpoint_under_concurrent_producers_and_a_consumer_is_consistent(
    tmp_path: Path,
) -> None:
    server = Server(
        example(),
        8,
        transport=TcpTransport(port=0, host=LOCALHOST),
        num_buffers=4,
        producer_queue_size=16,
    )
    server.start()
    stop = threading.Event()  # producers stop
    done = threading.Event()  # the consumer stops (after the producers)
    errors: list[BaseException] = []
    received: list[int] = []
    lock = threading.Lock()
    per_producer = 20_000  # bounds the run whatever happens

    def submitter(p: int) -> None:
        try:
            for seq in range(per_producer):
                if stop.is_set():
                    return
                server.submit(item(p << 32 | seq), timeout=WAIT_S)
        except BaseException as e:  # noqa: BLE001 -- reported by the test
            errors.append(e)

    def sender(p: int) -> None:
        try:
            client = TcpClient(LOCALHOST, server.port, example(), max_inflight_msgs=8)
            try:
                for seq in range(per_producer):
                    if stop.is_set():
                        break
                    client.send(item(p << 32 | seq))
            finally:
                client.close(timeout=WAIT_S)
        except BaseException as e:  # noqa: BLE001 -- reported by the test
            if not stop.is_set():
                errors.append(e)

    def consumer() -> None:
        try:
            while not done.is_set():
                try:
                    sample = server.sample(timeout=0.2)
                except TimeoutError:
                    continue
                if sample is None:
                    return
                ids = batch_ids(sample)
                with lock:
                    received.extend(ids)
        except BaseException as e:  # noqa: BLE001 -- reported by the test
            errors.append(e)

    producers = [1, 2, 3, 4]
    threads = [threading.Thread(target=submitter, args=(p,)) for p in producers[:2]]
    threads += [threading.Thread(target=sender, args=(p,)) for p in producers[2:]]
    threads.append(threading.Thread(target=consumer))
    for t in threads:
        t.start()
    snapshots: list[tuple[list[int], dict[str, Any]]] = []
    try:
        wait_until(lambda: len(received) > 64, "the consumer to get going")
        for round_ in range(6):
            path = tmp_path / f"c{round_ % 2}"
            server.checkpoint(path)
            snapshots.append(checkpoint_rows(path))
    finally:
        stop.set()
        for t in threads[:-1]:
            t.join(timeout=30)
        done.set()
        threads[-1].join(timeout=30)
    alive = [t for t in threads if t.is_alive()]
    server.close()
    assert not alive
    assert not errors, errors
    with lock:
        got = list(received)
    for ids, counts in snapshots:
        check_consistent(ids, counts, got, producers)
    assert any(c["from_ring"] for _, c in snapshots), "some checkpoint caught the ring busy"
    # The last one restores to exactly its rows, in order.
    last_ids, last_counts = snapshots[-1]
    restored = Server.restore(tmp_path / "c1")
    with restored:
        out: list[int] = []
        for _ in range(len(last_ids) // 8):
            out += batch_ids(restored.sample(timeout=WAIT_S))
        assert out == last_ids[: len(out)]
        # What did not fit the ring goes in from the restore thread as room frees.
        rest = len(last_ids) - len(out)
        wait_until(lambda: restored.stats().store_size == rest, "the rest of the restore")
    assert last_counts["items"] == len(last_ids)


@pytest.mark.parametrize("stage", ["leaves-written", "before-swap"])
def test_a_process_killed_mid_fifo_checkpoint_leaves_the_previous_one_loadable(
    tmp_path: Path, stage: str
) -> None:
    path = tmp_path / "ckpt"
    kill_mid_checkpoint(path, stage, "num_buffers=16")
    restored = Server.restore(path)
    with restored:
        assert restored.stats().store_size == 10, "the first checkpoint, whole"
        for b in range(2):
            sample = restored.sample(timeout=WAIT_S)
            assert sample is not None
            expected = np.repeat(np.arange(4 * b, 4 * b + 4, dtype=np.uint8), 1024)
            np.testing.assert_array_equal(sample.batch["x"].reshape(-1), expected)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    with Server(example(), 2, num_buffers=4) as server:
        for i in range(5):
            server.submit(item(i))
        server.checkpoint(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_inconsistent_fifo_counts_are_reported(saved: Path) -> None:
    manifest = saved.resolve() / "manifest.json"
    data = json.loads(manifest.read_text())
    data["counts"]["from_ring"] += 1
    manifest.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"manifest\.json: malformed .*from_ring"):
        Server.restore(saved)
