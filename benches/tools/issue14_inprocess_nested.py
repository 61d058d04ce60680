"""In-process `submit()` of large nested samples against id-echo 0.2.1 (issue #14).

What the issue measured: ~196 KB samples of 40 float32 leaves in a nested dict (four
groups, one of them nested again), batch 64. A producer thread submits from a pool of 16
distinct samples (each stamped with its id first), a consumer thread calls `sample()` and
reads every byte of every leaf, checking every id arrives exactly once. Each side runs in
its own interpreter (this file with ``--child``), rounds interleaved (ours, 0.2.1, 0.2.1,
ours, ...). The reference is single-thread memcpy bandwidth: one contiguous copy of a
sample's bytes per sample into a ring-sized destination, measured in this process.

Run: ``python benches/tools/issue14_inprocess_nested.py --peer target/peer-venv/bin/python``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

LEAF = (1225,)  # float32: 4,900 bytes; 40 leaves: 196,000 bytes per sample
BATCH = 64
POOL = 16


def example() -> dict[str, Any]:
    def group(n: int, prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}{i}": np.zeros(LEAF, np.float32) for i in range(n)}

    return {
        "obs": group(10, "cam"),
        "next_obs": group(10, "cam"),
        "extras": {"a": group(5, "x"), "b": group(5, "y")},
        "policy": group(10, "h"),
    }


def leaves_of(tree: Any) -> list[np.ndarray]:
    if isinstance(tree, dict):
        return [leaf for key in sorted(tree) for leaf in leaves_of(tree[key])]
    return [tree]


def child(seconds: float) -> dict[str, Any]:
    import echo

    rng = np.random.default_rng(0)
    pool = []
    for _ in range(POOL):
        tree = example()
        for leaf in leaves_of(tree):
            leaf[...] = rng.standard_normal(LEAF).astype(np.float32)
        pool.append(tree)
    server = echo.Server(example(), batch_size=BATCH)
    stop = threading.Event()
    submitted = [0]

    def produce() -> None:
        i = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            tree = pool[i % POOL]
            tree["obs"]["cam0"][0] = i  # the id, exact in float32 below 2**24
            server.submit(tree)
            i += 1
        # Pad the last batch with markers so the consumer sees every id.
        while i % BATCH:
            tree = pool[i % POOL]
            tree["obs"]["cam0"][0] = -1
            server.submit(tree)
            i += 1
        submitted[0] = i
        stop.set()

    seen: list[int] = []
    touched = [0]

    def consume() -> None:
        while True:
            if stop.is_set() and len(seen) >= submitted[0]:
                return
            got = server.sample()
            if got is None:
                return
            batch = got[0] if isinstance(got, tuple) else got.batch
            # Every byte read, at memory speed: a wrapping uint32 sum (summing into uint64,
            # numpy's default, spent more time widening than reading, on both sides).
            total = 0
            for leaf in leaves_of(batch):
                total += int(np.add.reduce(leaf.view(np.uint32), axis=None, dtype=np.uint32))
            touched[0] += total
            seen.extend(int(v) for v in batch["obs"]["cam0"][:, 0])

    producer = threading.Thread(target=produce)
    consumer = threading.Thread(target=consume)
    started = time.perf_counter()
    producer.start()
    consumer.start()
    producer.join()
    consumer.join(timeout=30)
    elapsed = time.perf_counter() - started
    server.close()
    ids = [i for i in seen if i >= 0]
    n = len(ids)
    return {
        "samples_per_s": n / elapsed,
        "gb_per_s": n * 196_000 / elapsed / 1e9,
        "correct": sorted(ids) == list(range(n)) and n == len(set(ids)),
        "echo": getattr(echo, "__version__", "?"),
    }


def memcpy_reference(seconds: float) -> float:
    """Samples/s of plain single-thread memcpy: one contiguous 196,000-byte copy per sample
    into a destination ring as large as the server's (3 batches), so not from cache."""
    src = np.ones(196_000, np.uint8)
    ring = np.zeros((3 * BATCH, 196_000), np.uint8)
    n, deadline, started = 0, time.monotonic() + seconds, time.perf_counter()
    while time.monotonic() < deadline:
        np.copyto(ring[n % len(ring)], src)
        n += 1
    return n / (time.perf_counter() - started)


def run_side(python: str, seconds: float) -> dict[str, Any]:
    out = subprocess.run(
        [python, __file__, "--child", "--seconds", str(seconds)],
        capture_output=True,
        text=True,
        timeout=seconds + 120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--peer", help="python of a virtualenv with id-echo 0.2.1")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.seconds)))
        return
    sides = {"ours": sys.executable, **({"0.2.1": args.peer} if args.peer else {})}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.repeats):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            res = run_side(sides[name], args.seconds)
            assert res["correct"], (name, res)
            rates[name].append(res["samples_per_s"])
            print(
                f"round {r} {name:>6}: {res['samples_per_s']:>9,.0f} samples/s "
                f"{res['gb_per_s']:.2f} GB/s (echo {res['echo']})",
                flush=True,
            )
    memcpy = memcpy_reference(args.seconds)
    print(
        f"memcpy reference (one thread, contiguous): {memcpy:,.0f} samples/s "
        f"{memcpy * 196_000 / 1e9:.2f} GB/s"
    )
    med = {name: statistics.median(v) for name, v in rates.items()}
    for name, value in med.items():
        print(f"median {name:>6}: {value:>9,.0f} samples/s, {value / memcpy:.2f} of memcpy")
    if "0.2.1" in med:
        print(f"ours / 0.2.1: {med['ours'] / med['0.2.1']:.2f}x")


if __name__ == "__main__":
    main()
