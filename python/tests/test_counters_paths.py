"""The ingress counters mean the same on both paths a same-host worker can take: TCP frames
(`TcpClient(shared_memory=False)`) and the shared-memory ring (`shared_memory=True`).

One workload, run over each path against the same kind of learner: a worker sends more than
the learner lets in while it does not sample (a full FIFO ring, or a rate limiter holding
inserts back), then the learner samples until everything is in. The counters that must move
(producers held back, samples waiting, time blocked by the limiter) are compared between the
paths, never durations: only whether they grew, and exact counts.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
from conftest import WAIT_S, Worker, poll

import echo
from echo import Server, TcpClient, TcpTransport

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="shared memory is Linux-only")

LOCALHOST = "127.0.0.1"
EXAMPLE = {"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}
SENT = 200
BATCH = 4


def _sample(v: int) -> dict[str, np.ndarray]:
    return {"id": np.array(v, np.int64), "obs": np.full((3,), v, np.float32)}


def _learner(make_server: Any, backend: str) -> Server:
    """A learner that holds producers back while it does not sample: a FIFO ring of two
    batches, or a replay table whose limiter lets 12 inserts ahead of the samples."""
    kwargs: dict[str, Any] = {"num_buffers": 2}
    if backend == "replay":
        kwargs = {
            "sampler": echo.Uniform(),
            "max_size": 1000,
            "rate_limiter": echo.SampleToInsertRatio(1.0, BATCH, 8.0),
            "seed": 0,
        }
    server = make_server(
        EXAMPLE,
        batch_size=BATCH,
        producer_queue_size=4,
        transport=TcpTransport(port=0, host=LOCALHOST),
        **kwargs,
    )
    server.start()
    return server


def _send(port: int, shared_memory: bool) -> str:
    with TcpClient(LOCALHOST, port, EXAMPLE, shared_memory=shared_memory) as client:
        path = client.transport_path
        for i in range(SENT):
            client.send(_sample(i), timeout=WAIT_S)
        client.wait(timeout=WAIT_S)
    return path


def _run(make_server: Any, backend: str, shared_memory: bool) -> dict[str, Any]:
    """The workload over one path; what the counters showed while the worker was held back
    and once everything was in."""
    server = _learner(make_server, backend)
    worker = Worker(_send, server.port, shared_memory)
    worker.start()
    # Nobody samples: the worker is held back with samples on their way, queued in the
    # ingress (TCP) or committed to its segment (shared memory).
    held = poll(
        server.stats,
        lambda s: (
            s.push_blocked_count > 0
            and s.samples_pending > 0
            and s.queue_depth_sum > 0
            and s.queue_depth_max > 0
        ),
        "the worker held back with samples waiting",
    )
    assert held.samples_inserted_total < SENT
    for _ in range(10 * SENT):
        if server.stats().samples_inserted_total == SENT:
            break
        assert server.sample(timeout=WAIT_S) is not None
    path = worker.finish()
    done = poll(
        server.stats,
        lambda s: s.active_connections == 0 and s.samples_pending == 0 and s.queue_depth_sum == 0,
        "everything in and the worker gone",
    )
    server.close()
    return {
        "path": path,
        "held back": held.push_blocked_count > 0,
        "waiting while held": held.samples_pending > 0,
        "queued while held": (held.queue_depth_sum > 0, held.queue_depth_max > 0),
        "limiter blocked time grew": done.insert_blocked_ns_total > 0,
        "ring blocked time grew": done.ring_blocked_ns_total > 0,
        "backpressure time grew": done.push_blocked_ns_total > 0,
        "inserted": done.samples_inserted_total,
        "pending after": done.samples_pending,
        "queued after": (done.queue_depth_sum, done.queue_depth_max),
    }


@pytest.mark.parametrize("backend", ["fifo", "replay"])
def test_the_same_workload_moves_the_same_counters_over_tcp_and_shared_memory(
    make_server: Any, backend: str
) -> None:
    tcp = _run(make_server, backend, shared_memory=False)
    shm = _run(make_server, backend, shared_memory=True)
    assert (tcp.pop("path"), shm.pop("path")) == ("tcp", "shm")
    assert tcp == shm, f"TCP {tcp} vs shared memory {shm}"
    assert tcp == {
        "held back": True,
        "waiting while held": True,
        "queued while held": (True, True),
        # A replay table's inserts wait on its limiter, the FIFO ring's writers on free slots;
        # either way the worker was held back.
        "limiter blocked time grew": backend == "replay",
        "ring blocked time grew": backend == "fifo",
        "backpressure time grew": True,
        "inserted": SENT,
        "pending after": 0,
        "queued after": (0, 0),
    }
