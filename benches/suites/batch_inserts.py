"""Vectorized inserts against one call per row: samples/s of `submit_batch` vs a
loop of `submit`, and of `send_batch` vs a loop of `send` over TCP, for a vectorized
environment's step of N rows of a small nested sample.

What users send: a nested dict of 8 leaves (~120 bytes per sample), a pool of distinct
batches (not one hot in cache), and a learner thread that reads every batch. The per-row
baseline gets its rows prepared in advance (a dict of row views per sample), so it measures
the calls, not the slicing. Rounds are interleaved (per-row, batch, per-row, ...) and each is
bounded in time. Run: ``python -m benches batch-inserts [--quick] [--set n=256]``.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import numpy as np

import echo
from benches import common as c

EXAMPLE = {
    "obs": {
        "state": np.zeros((8,), np.float32),
        "goal": np.zeros((4,), np.float32),
        "mask": np.zeros((6,), np.bool_),
    },
    "action": np.zeros((2,), np.float32),
    "reward": np.zeros((), np.float32),
    "done": np.zeros((), np.bool_),
    "logp": np.zeros((), np.float32),
    "step": np.zeros((), np.int64),
}
POOL = 32  # distinct batches cycled through


def make_batches(n: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(POOL):
        out.append(
            {
                "obs": {
                    "state": rng.standard_normal((n, 8)).astype(np.float32),
                    "goal": rng.standard_normal((n, 4)).astype(np.float32),
                    "mask": rng.random((n, 6)) < 0.5,
                },
                "action": rng.standard_normal((n, 2)).astype(np.float32),
                "reward": rng.standard_normal(n).astype(np.float32),
                "done": rng.random(n) < 0.01,
                "logp": rng.standard_normal(n).astype(np.float32),
                "step": np.arange(n, dtype=np.int64),
            }
        )
    return out


def row_views(batch: dict[str, Any], n: int) -> list[dict[str, Any]]:
    return [
        {
            "obs": {k: v[i] for k, v in batch["obs"].items()},
            "action": batch["action"][i],
            "reward": batch["reward"][i],
            "done": batch["done"][i],
            "logp": batch["logp"][i],
            "step": batch["step"][i],
        }
        for i in range(n)
    ]


class Learner:
    """Reads every batch on a thread, counting samples."""

    def __init__(self, server: echo.Server, batch_size: int) -> None:
        self.server, self.batch_size, self.seen = server, batch_size, 0
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        for sample in self.server.dataset_iter():
            float(sample.batch["reward"][0])  # touch the batch
            self.seen += self.batch_size


def _rate(step: Any, seconds: float, per_call: int) -> float:
    """Samples/s of calling `step()` (which inserts `per_call` samples) for `seconds`."""
    calls, start = 0, time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline and calls < 10_000_000:
        step()
        calls += 1
    return calls * per_call / (time.perf_counter() - start)


def run(
    n: int, seconds: float, repeats: int, queue: int | None
) -> tuple[dict[str, list[float]], int]:
    batches = make_batches(n)
    per_row = [row_views(b, n) for b in batches]
    results: dict[str, list[float]] = {
        k: [] for k in ("submit", "submit_batch", "send", "send_batch")
    }

    server = echo.Server(EXAMPLE, batch_size=n, num_buffers=64)
    server.start()
    Learner(server, n)
    # One connection's ingress queue holds `queue` samples (producer_queue_size; the default
    # None picks 64 KiB worth, 256 of these): a batched sender needs room for a batch, or the
    # connection waits on the drainer every `queue` samples (try --queue 8, the old default).
    tcp = echo.Server(
        EXAMPLE,
        batch_size=n,
        num_buffers=64,
        transport=echo.TcpTransport(0, host="127.0.0.1"),
        producer_queue_size=queue,
    )
    tcp.start()
    tcp_queue = tcp.producer_queue_size
    assert tcp.port is not None
    Learner(tcp, n)
    client = echo.TcpClient("127.0.0.1", tcp.port, EXAMPLE, max_inflight_msgs=256)
    k = [0]

    def one_by_one() -> None:
        for row in per_row[k[0] % POOL]:
            server.submit(row)
        k[0] += 1

    def batched() -> None:
        server.submit_batch(batches[k[0] % POOL])
        k[0] += 1

    def send_rows() -> None:
        for row in per_row[k[0] % POOL]:
            client.send(row)
        k[0] += 1

    def send_batched() -> None:
        client.send_batch(batches[k[0] % POOL])
        k[0] += 1

    for _ in range(repeats):
        results["submit"].append(_rate(one_by_one, seconds, n))
        results["submit_batch"].append(_rate(batched, seconds, n))
        results["send"].append(_rate(send_rows, seconds, n))
        results["send_batch"].append(_rate(send_batched, seconds, n))
    client.close()
    server.close()
    tcp.close()
    return results, tcp_queue


def parameters(quick: bool) -> dict[str, Any]:
    return {"n": 64, "seconds": 0.5 if quick else 2.0, "repeats": 1 if quick else 3, "queue": None}


def limit_s(params: dict[str, Any]) -> float:
    return 4 * int(params["repeats"]) * (float(params["seconds"]) + 5.0) + 60.0


def measure(params: dict[str, Any]) -> dict[str, Any]:
    res, tcp_queue = run(
        int(params["n"]), float(params["seconds"]), int(params["repeats"]), params["queue"]
    )
    return {"samples_per_s": res, "producer_queue_size": tcp_queue}


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    columns = ["echo", "path", "one call per row, samples/s", "batched, samples/s", "ratio"]
    rows = c.failed_rows(results, len(columns))
    for side, r in results.items():
        if "error" in r:
            continue
        med = {k: statistics.median(v) for k, v in r["samples_per_s"].items()}
        for name, row, batch in (
            ("in-process: submit / submit_batch", "submit", "submit_batch"),
            ("TCP: send / send_batch", "send", "send_batch"),
        ):
            rows.append(
                [side, name, c.num(med[row]), c.num(med[batch]), f"{med[batch] / med[row]:.1f}x"]
            )
    return [
        {
            "title": f"A vectorized environment's step of {params['n']} rows of a small nested "
            f"sample (8 leaves); medians of {params['repeats']} interleaved round(s) of "
            f"{params['seconds']:g} s",
            "columns": columns,
            "rows": rows,
        }
    ]
