"""Detailed metrics (cargo feature `detailed-metrics`): CAS counters and histograms.

The same tests run against both builds: in the default build every detailed field must be
zero (so `if info.memcpy.count > 0:` works everywhere); in a telemetry build
(`just install-telemetry`, or scripts/test.sh's second pass) they must count a scripted
workload exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

import echo

EXAMPLE = {"obs": np.zeros((4,), np.float32), "id": np.zeros((), np.int64)}
HISTOGRAMS = ("drain_round", "memcpy", "queue_dwell")


def _sample(i: int) -> dict[str, np.ndarray]:
    return {"obs": np.full((4,), i, np.float32), "id": np.array(i, np.int64)}


def test_in_process_workload_is_counted_exactly_or_zero() -> None:
    server = echo.Server(EXAMPLE, batch_size=8, num_buffers=4)
    try:
        for i in range(32):
            server.submit(_sample(i))
        samples = [server.sample(timeout=5) for _ in range(4)]
        last = samples[-1]
        assert last is not None
        info = last.info
        assert info.notify_count == 4
        assert info.samples_inserted_total == 0  # submit() is not a drainer
        if echo.DETAILED_METRICS:
            assert info.cas_success_total == 32  # one reservation per single-sample submit
            assert info.cas_failure_total == 0  # one writer: nothing to lose a race against
            assert info.memcpy.count == 32
            assert 0 < info.memcpy.min_ns <= info.memcpy.p50_ns <= info.memcpy.max_ns
            assert info.drain_round.count == 0
            assert info.queue_dwell.count == 0
        else:
            assert (info.cas_success_total, info.cas_failure_total) == (0, 0)
            assert info.reservation_retries_total == 0
            for name in HISTOGRAMS:
                hist = getattr(info, name)
                assert hist.count == 0
                assert hist.p99_ns == 0
                assert hist.mean_ns == 0.0
    finally:
        server.close()


def test_full_ring_counts_reservation_retries() -> None:
    server = echo.Server(EXAMPLE, batch_size=2, num_buffers=2)
    try:
        for i in range(4):
            server.submit(_sample(i))
        with pytest.raises(TimeoutError):
            server.submit(_sample(4), timeout=0.05)
        retries = server.stats().reservation_retries_total
        assert retries >= 1 if echo.DETAILED_METRICS else retries == 0
    finally:
        server.close()


def test_tcp_workload_fills_the_ingress_histograms() -> None:
    server = echo.Server(
        EXAMPLE,
        batch_size=8,
        num_buffers=16,  # room for all 64, so close() can flush before anything is sampled
        transport=echo.TcpTransport(port=0, host="127.0.0.1"),
    )
    server.start()
    assert server.port is not None
    try:
        # Over TCP: a same-host client would take shared memory, which skips the queues.
        client = echo.TcpClient("127.0.0.1", server.port, EXAMPLE, shared_memory=False)
        for i in range(64):
            client.send(_sample(i))
        assert client.close(timeout=10)
        ids = []
        for _ in range(8):
            got = server.sample(timeout=10)
            assert got is not None
            ids.extend(int(x) for x in got.batch["id"])
        assert ids == list(range(64))
        info = server.stats()
        assert info.samples_inserted_total == 64
        if echo.DETAILED_METRICS:
            assert info.queue_dwell.count == 64
            assert info.drain_round.count >= 1
            assert info.memcpy.count >= 1
            server.reset_histograms()
            after = server.stats()
            assert after.queue_dwell.count == 0
            assert after.memcpy.count == 0
            assert after.cas_success_total == info.cas_success_total  # counters stay
        else:
            for name in HISTOGRAMS:
                assert getattr(info, name).count == 0
            server.reset_histograms()  # a no-op, but callable
    finally:
        server.close()


def test_as_dict_carries_the_histograms() -> None:
    server = echo.Server(EXAMPLE, batch_size=1)
    try:
        server.submit(_sample(0))
        got = server.sample(timeout=5)
        assert got is not None
        d = got.info.as_dict()
        assert set(d["memcpy"]) == {
            "count", "min_ns", "max_ns", "mean_ns", "p50_ns", "p90_ns", "p99_ns"
        }  # fmt: skip
        assert d["memcpy"]["count"] == (1 if echo.DETAILED_METRICS else 0)
        assert d["sequence"] == 0
    finally:
        server.close()
