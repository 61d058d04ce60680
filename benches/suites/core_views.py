"""The cost of ``server.sample()`` when the batch is already complete, for any installed
``echo``, by the number of leaves of the pytree (default 1, 10 and 40).

With nothing to wait for, ``sample()`` is: give the previous batch back, build one read-only
numpy view per leaf into the ring (each with the ring's lease as its ``base``), unflatten the
leaves into the pytree and make the ``SampleInfo``. The view construction is the part that
grows with the number of leaves, so the slope between the leaf counts is its cost per leaf;
the criterion benches cannot measure it, because it lives in the pyo3 layer.

For each leaf count n the pytree is a dict of n ``f32[4]`` leaves (the leaves' size does not
matter: nothing is copied), batch size 32, the ``Server``'s other settings at their defaults
(in-process, no transport, never ``start()``-ed, as ``core_inprocess.py`` does, so that
id-echo 0.2.1 runs it too). Each repetition drops the previous ``Sample`` and submits one
batch (untimed), then times ``server.sample()`` alone with ``time.perf_counter_ns()``. After
20 untimed repetitions it repeats for ``--seconds`` (1 s; ``--quick`` 0.15 s) or 200,000
times, whichever comes first, and reports the median, the 10th, 90th and 99th percentiles in
microseconds. ``correct`` says that every timed call returned a batch whose leaves have the
submitted values; ``zero_copy`` that they are read-only arrays with a ``base`` (views).

Every loop is bounded in count and in time; the server is closed 10 s after a leaf count's
window should have ended (a ``sample()`` that never returns then wakes with ``None``), and a
watchdog ends the process after ``--max-seconds``. No network, no threads besides the guards.

    python -m benches.suites.core_views [--quick] [--leaves 1,10,40] [--json PATH]

``python -m benches`` runs it for each interpreter it compares. Depends on numpy, echo and the
standard library only.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

import echo
from benches import common as h
from echo import Server

LEAF_COUNTS = (1, 10, 40)
MAX_LEAVES = 1000
BATCH_SIZE = 32
LEAF_SHAPE = (4,)
WARMUP = 20
MAX_CALLS = 200_000
CLOSE_GRACE_S = 10.0
SCENARIO = "sample"  # the one scenario of this script, as python -m benches files it
_log = h.logger("bench_views")


def example(n_leaves: int) -> dict[str, np.ndarray]:
    """A flat dict of ``n_leaves`` ``f32[4]`` leaves; leaf ``i`` holds ``i`` everywhere."""
    return {f"x{i:03d}": np.full(LEAF_SHAPE, i, np.float32) for i in range(n_leaves)}


def measure(n_leaves: int, seconds: float) -> dict[str, Any]:
    """``sample()`` on a complete batch of an ``n_leaves``-leaf pytree, in microseconds."""
    tree = example(n_leaves)
    times = np.zeros(MAX_CALLS, np.int64)
    got = 0
    error: str | None = None
    correct = zero_copy = True
    server = Server(tree, batch_size=BATCH_SIZE)
    guard = h.call_later(seconds + CLOSE_GRACE_S, server.close)
    try:
        clock = time.perf_counter_ns
        submit, sample = server.submit, server.sample
        deadline = time.perf_counter() + seconds
        smp: Any = None
        for k in range(WARMUP + MAX_CALLS):
            smp = None  # drop the previous batch's views outside the timed region
            for _ in range(BATCH_SIZE):
                submit(tree)
            t0 = clock()
            smp = sample()
            t1 = clock()
            if smp is None:
                error = "sample() returned None: the server was closed (stuck)"
                correct = False
                break
            if k >= WARMUP:
                times[got] = t1 - t0
                got += 1
            if k in (0, WARMUP):  # check the layout, outside the timed region
                batch = smp.batch
                for i, (key, leaf) in enumerate(batch.items()):
                    want = (BATCH_SIZE, *LEAF_SHAPE)
                    correct = correct and leaf.shape == want and bool(np.all(leaf == i))
                    correct = correct and key == f"x{i:03d}"
                    zero_copy = zero_copy and leaf.base is not None and not leaf.flags.writeable
                correct = correct and len(batch) == n_leaves
            if got >= 1 and time.perf_counter() >= deadline:
                break
        smp = None
    except (RuntimeError, ValueError, TypeError, OSError) as e:
        error = f"{type(e).__name__}: {e}"
        correct = False
    finally:
        guard.cancel()
        server.close()
    t = times[:got] / 1e3
    if got == 0:
        return {"leaves": n_leaves, "calls": 0, "correct": False, "error": error}

    def pct(q: float) -> float:
        return float(np.percentile(t, q))

    return {
        "leaves": n_leaves,
        "batch_size": BATCH_SIZE,
        "calls": got,
        "us_per_call": pct(50),
        "p10_us": pct(10),
        "p90_us": pct(90),
        "p99_us": pct(99),
        "mean_us": float(t.mean()),
        "correct": correct,
        "zero_copy": zero_copy,
        "error": error,
    }


def run(leaf_counts: list[int], seconds: float) -> dict[str, Any]:
    """Every leaf count, with the per-leaf slope between the fewest and the most leaves."""
    by_leaves = {str(n): measure(n, seconds) for n in leaf_counts}
    lo, hi = by_leaves[str(min(leaf_counts))], by_leaves[str(max(leaf_counts))]
    slope: float | None = None
    if hi["leaves"] > lo["leaves"] and lo.get("calls") and hi.get("calls"):
        slope = (hi["us_per_call"] - lo["us_per_call"]) / (hi["leaves"] - lo["leaves"])
    return {
        "batch_size": BATCH_SIZE,
        "leaf_shape": list(LEAF_SHAPE),
        "seconds_per_count": seconds,
        "by_leaves": by_leaves,
        "us_per_extra_leaf": slope,
        "correct": all(r.get("correct") for r in by_leaves.values()),
    }


def main(argv: list[str] | None = None) -> int:
    p = h.bench_parser(__doc__, "0.15 s per leaf count", max_seconds=120.0)
    p.add_argument(
        "--leaves", type=h.int_list("leaf counts", MAX_LEAVES), default=list(LEAF_COUNTS)
    )
    p.add_argument("--seconds", type=float, default=None, help="window per leaf count (1)")
    args = p.parse_args(argv)
    seconds: float = args.seconds or (0.15 if args.quick else 1.0)
    if not 0.01 <= seconds <= 60:
        p.error("--seconds must be in [0.01, 60]")
    h.start_watchdog(args.max_seconds, "bench_views")
    label = h.default_label(args.label, echo)
    res = run(sorted(set(args.leaves)), seconds)
    print(h.run_title(label, echo))
    print(f"{'leaves':>6} {'calls':>8} {'p50 us':>8} {'p10 us':>8} {'p90 us':>8} {'p99 us':>8}")
    for n, r in res["by_leaves"].items():
        if not r.get("calls"):
            print(f"{n:>6} {0:>8} failed: {r.get('error')}")
            continue
        print(
            f"{n:>6} {r['calls']:>8,} {r['us_per_call']:>8.2f} {r['p10_us']:>8.2f} "
            f"{r['p90_us']:>8.2f} {r['p99_us']:>8.2f}"
            + ("" if r["correct"] else f"  NOT CORRECT ({r.get('error')})")
        )
    if res["us_per_extra_leaf"] is not None:
        print(f"  per extra leaf: {res['us_per_extra_leaf']:.3f} us")
    _log(f"correct {res['correct']}")
    if args.json is not None:
        doc = {
            **h.run_facts(label, echo),
            "quick": args.quick,
            "loadavg_after": h.loadavg(),
            "scenarios": {SCENARIO: res},
        }
        h.write_json(args.json, doc)
    return 0 if res["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
