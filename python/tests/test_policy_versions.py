"""Policy versions on samples: every sample carries the version of the parameters that made
it (the one its worker last fetched, or the one `send(version=)` names), batches hand them out
as `Sample.versions`, and `max_staleness=k` keeps samples more than k versions behind the
latest publish from the learner: dropped as they go in, skipped by a FIFO ring, or removed
from a replay or sequence table when a draw meets them, each counted once by cause. With
`admission="block"` a worker that far behind waits in `send()` until it has newer
parameters. Exactly-once holds for every sample that is not stale (unique ids)."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest
from conftest import WAIT_S, poll

from echo import Sequence, Server, TcpClient, TcpTransport, Uniform

LOCALHOST = "127.0.0.1"
EXAMPLE = {"id": np.zeros((), np.int64), "obs": np.zeros(3, np.float32)}


def weights(version: int) -> dict[str, Any]:
    return {"w": np.full(8, version, np.float32)}


def sample_of(i: int) -> dict[str, Any]:
    return {"id": np.array(i, np.int64), "obs": np.full(3, i, np.float32)}


def rows_of(ids: Any) -> dict[str, Any]:
    ids = np.asarray(ids, np.int64)
    return {"id": ids, "obs": np.repeat(ids[:, None], 3, axis=1).astype(np.float32)}


def publish_up_to(learner: Server, version: int) -> None:
    while learner.params_version < version:
        learner.publish(weights(learner.params_version + 1))


def drain(learner: Server, expected: int) -> tuple[list[int], list[int]]:
    """Every id and version the learner is handed until `expected` samples came."""
    ids: list[int] = []
    versions: list[int] = []
    while len(ids) < expected:
        got = learner.sample(timeout=WAIT_S)
        assert got is not None
        ids += got.batch["id"].tolist()
        assert got.versions is not None
        versions += got.versions.tolist()
        assert (got.batch["obs"][:, 0] == got.batch["id"]).all(), "a sample was garbled"
    return ids, versions


@pytest.mark.parametrize("path", ["tcp", "shm"])
def test_samples_carry_the_version_their_worker_fetched_or_named(path: str) -> None:
    transport = TcpTransport(port=0, host=LOCALHOST, shared_memory=path == "shm")
    with Server(EXAMPLE, 4, transport=transport, policy_versions=True) as learner:
        worker = TcpClient(
            LOCALHOST,
            learner.port,
            EXAMPLE,
            params_example=weights(0),
            shared_memory=path == "shm",
        )
        assert worker.transport_path == path
        assert worker.keeps_versions
        assert worker.policy_version == 0
        worker.send(sample_of(0))  # before any fetch: version 0
        learner.publish(weights(1))
        learner.publish(weights(7), version=7)
        assert worker.params(timeout=WAIT_S)[0] == 7
        assert worker.policy_version == 7
        worker.send(sample_of(1))
        worker.send(sample_of(2), version=5)
        worker.send_batch(rows_of([3, 4]), version=6)
        worker.send_batch(rows_of([5, 6, 7]))
        worker.policy_version = 9
        worker.send(sample_of(8))
        learner.submit(sample_of(9))  # in-process: the latest, 7
        learner.submit(sample_of(10), version=3)
        learner.submit_batch(rows_of([11]), version=2)
        worker.wait(timeout=WAIT_S)
        ids, versions = drain(learner, 12)
        assert dict(zip(ids, versions, strict=True)) == {
            0: 0,
            1: 7,
            2: 5,
            3: 6,
            4: 6,
            5: 7,
            6: 7,
            7: 7,
            8: 9,
            9: 7,
            10: 3,
            11: 2,
        }
        worker.close()


def test_a_server_without_versions_hands_out_none_and_ignores_them() -> None:
    transport = TcpTransport(port=0, host=LOCALHOST)
    with Server(EXAMPLE, 2, transport=transport) as learner:
        worker = TcpClient(LOCALHOST, learner.port, EXAMPLE)
        assert not worker.keeps_versions
        worker.send(sample_of(0), version=4)
        worker.send(sample_of(1))
        got = learner.sample(timeout=WAIT_S)
        assert got is not None
        assert got.versions is None
        assert got.batch["id"].tolist() == [0, 1]
        worker.close()


@pytest.mark.parametrize("path", ["tcp", "shm"])
def test_stale_samples_are_dropped_at_insert_counted_exactly_and_the_rest_arrive_once(
    path: str,
) -> None:
    """4 workers send 400 samples each with versions 0..10 while the learner stands at 10
    with max_staleness=3: exactly the samples below version 7 are dropped, every other id
    arrives once."""
    transport = TcpTransport(port=0, host=LOCALHOST, shared_memory=path == "shm")
    learner = Server(EXAMPLE, 16, num_buffers=8, transport=transport, max_staleness=3)
    learner.start()
    publish_up_to(learner, 10)
    rng = np.random.default_rng(7)
    plan = {w: rng.integers(0, 11, 400) for w in range(4)}

    def work(w: int) -> None:
        client = TcpClient(LOCALHOST, learner.port, EXAMPLE, shared_memory=path == "shm")
        for i, version in enumerate(plan[w]):
            client.send(sample_of(w * 1000 + i), version=int(version))
        client.wait(timeout=WAIT_S)
        client.close()

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    fresh = {w * 1000 + i for w in range(4) for i, v in enumerate(plan[w]) if v >= 7}
    stale = sum(int((plan[w] < 7).sum()) for w in range(4))
    try:
        # Whole batches only: the fresh samples are what a drain of full batches can reach.
        whole = len(fresh) // 16 * 16
        ids, versions = drain(learner, whole)
        for t in threads:
            t.join()
        counted = poll(
            lambda: learner.stats().samples_stale_at_insert_total,
            lambda n: n >= stale,
            "the stale samples counted",
        )
        assert counted == stale
        poll(lambda: learner.stats().samples_pending, lambda n: n == 0, "the ingress drained")
        assert min(versions) >= 7
        assert len(ids) == len(set(ids)), "a sample arrived twice"
        assert set(ids) <= fresh
        assert learner.stats().samples_stale_at_sample_total == 0
    finally:
        learner.close()
    assert learner.dropped_at_close == len(fresh) - whole


@pytest.mark.parametrize("copy", [False, True])
def test_a_fifo_ring_skips_samples_that_became_stale_while_they_waited(copy: bool) -> None:
    """Batches wholly fresh go out as they lie; a batch with stale rows is gathered with the
    next ones' fresh rows, in order, each stale row counted once, nothing lost."""
    with Server(EXAMPLE, 4, num_buffers=4, max_staleness=1) as learner:
        publish_up_to(learner, 2)
        learner.submit_batch(rows_of(range(8)))  # version 2
        first = learner.sample(timeout=WAIT_S, copy=copy)
        assert first is not None
        assert first.batch["id"].tolist() == [0, 1, 2, 3]
        learner.submit_batch(rows_of(range(8, 12)), version=3)
        publish_up_to(learner, 4)  # 2 is stale now (ids 4..7), 3 is not
        learner.submit_batch(rows_of(range(12, 16)), version=4)
        second = learner.sample(timeout=WAIT_S, copy=copy)
        assert second is not None
        assert second.versions is not None
        assert second.batch["id"].tolist() == [8, 9, 10, 11]
        assert second.versions.tolist() == [3, 3, 3, 3]
        assert (second.batch["obs"][:, 0] == second.batch["id"]).all()
        assert learner.stats().samples_stale_at_sample_total == 4
        learner.submit_batch(rows_of([16, 17]), version=2)  # stale as they go in
        learner.submit_batch(rows_of([18]), version=3)
        publish_up_to(learner, 5)  # now 3 is stale too: 18 is skipped at sample time
        learner.submit_batch(rows_of(range(19, 26)), version=5)
        third = learner.sample(timeout=WAIT_S, copy=copy)
        fourth = learner.sample(timeout=WAIT_S, copy=copy)
        assert third is not None
        assert fourth is not None
        assert third.batch["id"].tolist() == [12, 13, 14, 15]
        assert fourth.batch["id"].tolist() == [19, 20, 21, 22]
        stats = learner.stats()
        assert stats.samples_stale_at_insert_total == 2
        assert stats.samples_stale_at_sample_total == 5
        assert [third.info.sequence, fourth.info.sequence] == [2, 3]


def test_a_replay_table_removes_items_that_became_stale_while_they_waited() -> None:
    with Server(EXAMPLE, 4, sampler=Uniform(), max_size=1000, max_staleness=2, seed=3) as learner:
        publish_up_to(learner, 1)
        learner.submit_batch(rows_of(range(50)))  # version 1
        learner.submit_batch(rows_of(range(50, 80)), version=0)
        publish_up_to(learner, 3)  # 0 is stale now, 1 is not
        learner.submit_batch(rows_of(range(100, 110)))  # version 3
        drawn: Counter[int] = Counter()
        for _ in range(100):
            got = learner.sample(timeout=WAIT_S)
            assert got is not None
            assert got.versions is not None
            assert (got.versions >= 1).all()
            drawn.update(got.batch["id"].tolist())
        assert not set(drawn) & set(range(50, 80))
        stats = learner.stats()
        # Each stale item is counted once, when a draw first meets it (30 of them at most).
        assert 0 < stats.samples_stale_at_sample_total <= 30
        publish_up_to(learner, 6)  # versions 1 and 3 are stale now: only new items remain
        learner.submit_batch(rows_of(range(200, 204)), version=6)
        seen: set[int] = set()
        for _ in range(30):
            got = learner.sample(timeout=WAIT_S)
            assert got is not None
            assert got.versions is not None
            assert (got.versions == 6).all()
            seen.update(got.batch["id"].tolist())
        assert seen == {200, 201, 202, 203}
        removed = learner.stats().samples_stale_at_sample_total
        # Every item older than version 4 that was still in the table is removed once at most.
        assert removed <= 90
        assert learner.stats().samples_stale_at_insert_total == 0


def test_a_sequence_table_hands_out_a_version_per_step() -> None:
    learner = Server(
        EXAMPLE, 2, sequence=Sequence(length=3), max_size=64, policy_versions=True, seed=1
    )
    with learner:
        for step in range(6):
            learner.submit(sample_of(step), stream=0, version=10 + step)
        got = learner.sample(timeout=WAIT_S)
        assert got is not None
        assert got.versions is not None
        assert got.versions.shape == (2, 3)
        assert (got.versions == got.batch["id"] + 10).all()


def test_a_sequence_table_removes_windows_with_a_step_that_became_stale() -> None:
    """Windows of 3 (one starting at each step) over steps 0..5 of one stream: steps 0-2 made
    by version 1, 3-5 by version 3. Once version 3 is published (bound 1) the windows with a
    step of version 1 are removed as draws meet them, each counted once; only [3, 4, 5] is
    handed out."""
    sequence = Sequence(length=3, period=1)
    learner = Server(EXAMPLE, 2, sequence=sequence, max_size=64, max_staleness=1, seed=1)
    with learner:
        publish_up_to(learner, 1)
        for step in range(3):
            learner.submit(sample_of(step), stream=0, version=1)
        publish_up_to(learner, 3)
        for step in range(3, 6):
            learner.submit(sample_of(step), stream=0, version=3)
        for _ in range(20):
            got = learner.sample(timeout=WAIT_S)
            assert got is not None
            assert got.versions is not None
            assert (got.versions == 3).all(), got.versions
            assert got.batch["id"].tolist() == [[3, 4, 5], [3, 4, 5]]
        stats = learner.stats()
        assert stats.samples_stale_at_insert_total == 0
        # Windows [0..2], [1..3] and [2..4] hold a step of version 1: removed once each.
        assert stats.samples_stale_at_sample_total == 3


def test_blocking_admission_holds_a_worker_too_far_behind_until_it_fetches() -> None:
    transport = TcpTransport(port=0, host=LOCALHOST)
    learner = Server(EXAMPLE, 2, transport=transport, max_staleness=1, admission="block")
    with learner:
        learner.publish(weights(1))
        worker = TcpClient(LOCALHOST, learner.port, EXAMPLE, params_example=weights(0))
        worker.params(timeout=WAIT_S)
        worker.send(sample_of(0))
        publish_up_to(learner, 3)
        poll(lambda: worker.params_version, lambda v: v == 3, "the version notice")
        with pytest.raises(TimeoutError, match=r"version 1 and the learner is at 3"):
            worker.send(sample_of(1), timeout=0.2)
        assert worker.sent == 1, "a held-back sample is not sent"

        def fetch_later() -> None:
            time.sleep(0.3)
            worker.params(timeout=WAIT_S)

        fetcher = threading.Thread(target=fetch_later)
        fetcher.start()
        started = time.monotonic()
        worker.send(sample_of(2), timeout=WAIT_S)  # released by the fetch
        fetcher.join()
        assert time.monotonic() - started >= 0.2
        assert worker.admission_waits >= 1
        assert worker.admission_wait_s > 0.2
        worker.wait(timeout=WAIT_S)
        got = learner.sample(timeout=WAIT_S)
        assert got is not None
        assert got.versions is not None
        assert got.batch["id"].tolist() == [0, 2]
        assert got.versions.tolist() == [1, 3]
        # Blocking admission drops nothing.
        assert learner.stats().samples_stale_at_insert_total == 0
        worker.close()


def test_a_checkpoint_keeps_the_versions_and_the_bound(tmp_path: Any) -> None:
    path = os.fspath(tmp_path / "ckpt")
    with Server(EXAMPLE, 2, sampler=Uniform(), max_size=100, max_staleness=4) as learner:
        learner.submit_batch(rows_of(range(10)), version=2)
        learner.checkpoint(path)
    restored = Server.restore(path)
    with restored:
        got = restored.sample(timeout=WAIT_S)
        assert got is not None
        assert got.versions is not None
        assert (got.versions == 2).all()
        publish_up_to(restored, 7)  # 2 is 5 behind: stale under the restored bound
        restored.submit_batch(rows_of([50, 51]))
        got = restored.sample(timeout=WAIT_S)
        assert got is not None
        assert sorted(got.batch["id"].tolist()) in ([50, 50], [50, 51], [51, 51])


def test_bad_settings_and_versions_are_refused_precisely() -> None:
    with pytest.raises(ValueError, match=r"max_staleness must be in \[0, \d+\], got -1"):
        Server(EXAMPLE, 2, max_staleness=-1)
    with pytest.raises(ValueError, match="admission must be 'drop' or 'block', got 'x'"):
        Server(EXAMPLE, 2, max_staleness=1, admission="x")
    with pytest.raises(ValueError, match="admission='block' needs max_staleness"):
        Server(EXAMPLE, 2, admission="block")
    with pytest.raises(TypeError, match="policy_versions must be a bool"):
        Server(EXAMPLE, 2, policy_versions=1)  # type: ignore[arg-type]
    transport = TcpTransport(port=0, host=LOCALHOST)
    with Server(EXAMPLE, 2, transport=transport, policy_versions=True) as learner:
        worker = TcpClient(LOCALHOST, learner.port, EXAMPLE)
        with pytest.raises(ValueError, match=r"version must be in \[0, \d+\], got -1"):
            worker.send(sample_of(0), version=-1)
        with pytest.raises(OverflowError):
            learner.submit(sample_of(0), version=-1)
        worker.close()


def test_a_protocol_1_client_cannot_feed_a_learner_that_keeps_versions() -> None:
    transport = TcpTransport(port=0, host=LOCALHOST)
    learner = Server(EXAMPLE, 2, transport=transport, policy_versions=True)
    with learner, pytest.raises(ValueError, match="it has 3 leaves, data_sample has 2"):
        TcpClient(LOCALHOST, learner.port, EXAMPLE, protocol=1)


def test_prometheus_counts_stale_samples_by_cause() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from echo.metrics import EchoCollector

    with Server(EXAMPLE, 2, max_staleness=0) as learner:
        publish_up_to(learner, 2)
        learner.submit_batch(rows_of(range(3)), version=1)
        registry = CollectorRegistry()
        registry.register(EchoCollector(learner))
        text = generate_latest(registry).decode()
        lines = [line for line in text.splitlines() if line.startswith("echo_samples_dropped")]
        assert 'echo_samples_dropped_total{reason="stale_at_insert",server="default"} 3.0' in (
            lines
        ), lines
        assert 'echo_samples_dropped_total{reason="stale_at_sample",server="default"} 0.0' in (
            lines
        ), lines


def test_the_lag_of_what_the_learner_gets_and_the_parameters_served_are_counted() -> None:
    transport = TcpTransport(port=0, host=LOCALHOST)
    with Server(EXAMPLE, 4, transport=transport, policy_versions=True) as learner:
        learner.publish(weights(5), version=5)
        worker = TcpClient(
            LOCALHOST, learner.port, EXAMPLE, params_example=weights(0), shared_memory=False
        )
        assert (worker.params_fetches, worker.params_fetch_s) == (0, 0.0)
        worker.params(timeout=WAIT_S)
        worker.params(timeout=WAIT_S)
        assert worker.params_fetches == 2
        assert worker.params_fetch_s > 0
        worker.send_batch(rows_of(range(4)), version=2)  # lag 3 when handed out at 5
        worker.wait(timeout=WAIT_S)
        got = learner.sample(timeout=WAIT_S)
        assert got is not None
        learner.submit_batch(rows_of(range(4, 8)))  # the latest: lag 0
        assert learner.sample(timeout=WAIT_S) is not None
        stats = learner.stats()
        assert stats.samples_versioned_total == 8
        assert stats.version_lag_total == 12
        assert stats.version_lag_max == 3
        assert stats.params_version == 5
        assert stats.params_published_total == 1
        assert stats.params_chunks_served_total == 2  # 32 bytes: one chunk per fetch
        assert stats.params_bytes_served_total == 2 * weights(0)["w"].nbytes
        worker.close()
        # On the same host a shared-memory worker copies from the learner's region: nothing
        # goes through its socket.
        local = TcpClient(
            LOCALHOST, learner.port, EXAMPLE, params_example=weights(0), shared_memory=True
        )
        assert local.params(timeout=WAIT_S)[0] == 5
        assert local.params_fetches == 1
        assert learner.stats().params_chunks_served_total == 2
        local.close()
