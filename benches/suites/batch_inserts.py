"""Vectorized inserts against one call per row (issue #15): samples/s of `submit_batch` vs a
loop of `submit`, and of `send_batch` vs a loop of `send` over TCP, for a vectorized
environment's step of N rows of a small nested sample.

What users send: a nested dict of 8 leaves (~120 bytes per sample), a pool of distinct
batches (not one hot in cache), and a learner thread that reads every batch. The per-row
baseline gets its rows prepared in advance (a dict of row views per sample), so it measures
the calls, not the slicing. Rounds are interleaved (per-row, batch, per-row, ...) and each is
bounded in time. Run: ``python benches/tools/issue15_batch_inserts.py [--n 64] [--seconds 2]``.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import numpy as np

import echo

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


def measure(step: Any, seconds: float, per_call: int) -> float:
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
        results["submit"].append(measure(one_by_one, seconds, n))
        results["submit_batch"].append(measure(batched, seconds, n))
        results["send"].append(measure(send_rows, seconds, n))
        results["send_batch"].append(measure(send_batched, seconds, n))
    client.close()
    server.close()
    tcp.close()
    return results, tcp_queue


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=64, help="rows per batch (vectorized envs)")
    parser.add_argument("--seconds", type=float, default=2.0, help="per round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--queue", type=int, default=None, help="the learner's producer_queue_size (default: auto)"
    )
    args = parser.parse_args()
    res, tcp_queue = run(args.n, args.seconds, args.repeats, args.queue)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(
        f"N = {args.n}, small nested samples (8 leaves), "
        f"medians of {args.repeats} interleaved rounds, producer_queue_size={tcp_queue}"
    )
    print(f"{'path':<14}{'per row (samples/s)':>22}{'batched (samples/s)':>22}{'ratio':>8}")
    for name, row, batch in (
        ("in-process", "submit", "submit_batch"),
        ("TCP", "send", "send_batch"),
    ):
        print(f"{name:<14}{med[row]:>22,.0f}{med[batch]:>22,.0f}{med[batch] / med[row]:>8.1f}x")


if __name__ == "__main__":
    main()
