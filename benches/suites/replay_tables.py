"""Replay benchmark: echo's replay tables at 1e6 items (the default), optionally
compared in the same run with DeepMind Reverb and TorchRL (``replay_peers.py`` run
under a separate virtualenv that holds them).

Usage::

    python -m benches.suites.replay_tables [--items 1000000] [--batch 256] [--seconds 3]
        [--peers PEER_PYTHON] [--json PATH]

Item: ``obs`` float32[8], ``action`` int32, ``reward`` float32 (40 bytes), the same as the
peer script. Measured through the public Python API, one process, single thread:

* ``fill``: ``submit()`` of N items into an empty table of ``max_size`` N (no eviction), for
  a prioritized (exponent 0.6) and a uniform table -> inserts/s; and the same into the full
  prioritized table (every insert evicts the oldest item), next to ``submit()`` into a FIFO
  server whose consumer thread drains it (a prioritized insert should cost within 2x of a FIFO
  insert).
* ``sample``: ``sample()`` of batches of ``--batch`` from the full tables -> batches/s and
  items/s (each batch is gathered into the batch area; the leaves are read with ``sum()`` so
  nothing is left lazy).
* ``update_priorities``: ``--batch`` random live keys with random priorities -> calls/s and
  keys/s.

With ``--peers PYTHON`` the peer script runs right after ours (``--only all``; Reverb and
TorchRL each in their own subprocess), and the table shows ratios echo / peer. Every loop is
bounded in count and time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import threading
import time
from typing import Any

import numpy as np

import echo
from benches import common as h


def example() -> dict[str, np.ndarray]:
    return {
        "obs": np.zeros(8, np.float32),
        "action": np.zeros((), np.int32),
        "reward": np.zeros((), np.float32),
    }


def items(n: int) -> list[dict[str, np.ndarray]]:
    """``n`` distinct prebuilt items (generation is not timed)."""
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((n, 8)).astype(np.float32)
    return [
        {"obs": obs[i], "action": np.array(i % 4, np.int32), "reward": np.array(0.5, np.float32)}
        for i in range(n)
    ]


def fill(server: echo.Server, data: list[dict[str, np.ndarray]], seconds: float) -> float:
    """Submits every item (bounded by ``seconds`` * 20); returns inserts/s."""
    start = time.perf_counter()
    deadline = start + seconds * 20
    done = 0
    for item in data:
        server.submit(item, timeout=10.0)
        done += 1
        if done % 10_000 == 0 and time.perf_counter() > deadline:
            break
    return done / (time.perf_counter() - start)


def fifo_insert_rate(data: list[dict[str, np.ndarray]], batch: int, seconds: float) -> float:
    server = echo.Server(example(), batch, num_buffers=64)

    def drain() -> None:
        while server.sample() is not None:
            pass

    consumer = threading.Thread(target=drain, daemon=True)
    consumer.start()
    n = min(len(data), 2_000_000)
    rate = fill(server, data[:n], seconds)
    server.close()
    consumer.join(10)
    return rate


def bench(args: argparse.Namespace) -> dict[str, Any]:
    n, batch, seconds = args.items, args.batch, args.seconds
    data = items(n)
    out: dict[str, Any] = {}
    rng = np.random.default_rng(1)
    for name, sampler in (("prioritized", echo.Prioritized(0.6)), ("uniform", echo.Uniform())):
        server = echo.Server(example(), batch, sampler=sampler, max_size=n, seed=0)
        out[f"fill_{name}_inserts_per_s"] = fill(server, data, seconds)
        assert server.stats().store_size == n, "the table must be full before sampling"

        def draw(server: echo.Server = server) -> None:
            got = server.sample(timeout=10.0)
            assert got is not None
            got.batch["obs"].sum()

        calls, dt = h.timed_loop(draw, seconds, 1_000_000)
        out[f"sample_{name}_batches_per_s"] = calls / dt
        out[f"sample_{name}_items_per_s"] = calls * batch / dt
        if name == "prioritized":
            updates = [
                (rng.integers(0, n, size=batch).astype(np.uint64), rng.random(batch) + 0.01)
                for _ in range(64)
            ]
            cycle = itertools.cycle(updates)

            def update(server: echo.Server = server, cycle: Any = cycle) -> None:
                keys, priorities = next(cycle)
                server.update_priorities(keys, priorities)

            calls, dt = h.timed_loop(update, seconds, 1_000_000)
            out["update_priorities_calls_per_s"] = calls / dt
            out["update_priorities_keys_per_s"] = calls * batch / dt
            m = min(n, 500_000)
            out["insert_full_prioritized_per_s"] = fill(server, data[:m], seconds)
        server.close()
    out["insert_fifo_per_s"] = fifo_insert_rate(data, batch, seconds)
    out["prioritized_over_fifo_insert_cost"] = (
        out["insert_fifo_per_s"] / out["insert_full_prioritized_per_s"]
    )
    return out


def run_peers(python: str, args: argparse.Namespace) -> dict[str, Any]:
    """``python -m benches.suites.replay_peers --only all`` with the same sizes under
    ``python``."""
    cmd = [python, "-m", "benches.suites.replay_peers", "--only", "all"]
    for name in ("items", "batch", "seconds"):
        cmd += [f"--{name}", str(getattr(args, name))]
    return h.run_json_child(cmd, timeout_s=3600)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--peers", metavar="PYTHON", help="interpreter with dm-reverb/torchrl")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.items < args.batch or args.batch < 1 or args.seconds <= 0:
        parser.error("need items >= batch >= 1 and seconds > 0")
    ours = bench(args)
    result: dict[str, Any] = {
        "commit": h.git_commit(),
        "machine": {
            "cpu": h.cpu_model(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
        },
        "params": {"items": args.items, "batch": args.batch, "seconds": args.seconds},
        "echo": ours,
    }
    print(f"echo {echo.__version__}, {args.items:,} items, batch {args.batch}")
    for key, value in ours.items():
        print(f"  {key:42s} {value:>14,.1f}")
    if args.peers:
        result["peers"] = run_peers(args.peers, args)
        print(json.dumps(result["peers"], indent=1)[:4000])
    if args.json:
        h.write_json(args.json, result, say=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
