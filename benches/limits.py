"""The machine's raw limits, measured in the benchmark's own session.

Every echo number can then be read as a fraction of what the machine does without echo:

* ``memcpy``: single-thread ``np.copyto`` between two preallocated buffers, 64 MiB (memory
  bound: the reference) and 256 KiB (cache resident, for context). GB/s counts the bytes
  copied (1e9 B/s), best of three windows.
* ``loopback``: one process ``sendall``-ing 64 KiB (the reference) or 1 MiB chunks over
  ``127.0.0.1`` to another that ``recv_into``-s them, best of three transfers; this is
  ``core_tcp_workers.bench_loopback``, the same blast ``core_tcp.py`` uses on its own.
* ``flatten``: ``optree.tree_flatten`` of the in-process ``small`` pytree (2 leaves) and of
  the ``large`` one (40 leaves), microseconds per call: median and 10th percentile of
  batches of calls. That is the floor of the Python work of one ``submit()`` or ``send()``.

Every loop is bounded in count and in time.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import optree

from benches import common as h
from benches.suites import core_inprocess, core_tcp_scenarios, core_tcp_workers

MEMCPY_BYTES = 64 * 1024 * 1024
MEMCPY_CACHE_BYTES = 256 * 1024
FLATTEN_BATCH = 200  # calls per timed batch
MAX_REPS = 1_000_000


def memcpy(nbytes: int, seconds: float) -> dict[str, Any]:
    """Single-thread ``np.copyto`` of ``nbytes``: GB/s copied, best of three windows."""
    src = np.full(nbytes, 7, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in before timing
    runs: list[float] = []
    for _ in range(3):
        reps, elapsed = h.timed_loop(lambda: np.copyto(dst, src), seconds / 3, MAX_REPS, warmup=0)
        runs.append(reps * nbytes / elapsed / 1e9)
    return {"bytes": nbytes, "gbps": max(runs), "runs_gbps": runs}


def loopback(seconds: float, chunk_bytes: int) -> dict[str, Any]:
    """Raw loopback TCP between two processes (``core_tcp_workers.bench_loopback``), best of 3."""
    ctx = mp.get_context("forkserver")
    return core_tcp_workers.bench_loopback(ctx, seconds, chunk_bytes)


def flatten(tree: Any, seconds: float) -> dict[str, Any]:
    """``optree.tree_flatten(tree)`` in microseconds per call."""
    fn: Callable[[Any], Any] = optree.tree_flatten
    for _ in range(FLATTEN_BATCH):  # warm up
        fn(tree)
    per_call_ns: list[float] = []
    clock = time.perf_counter_ns
    deadline = time.perf_counter() + seconds
    for _ in range(MAX_REPS // FLATTEN_BATCH):
        t0 = clock()
        for _ in range(FLATTEN_BATCH):
            fn(tree)
        per_call_ns.append((clock() - t0) / FLATTEN_BATCH)
        if time.perf_counter() >= deadline:
            break
    ns = np.asarray(per_call_ns)
    leaves = len(optree.tree_leaves(tree))
    return {
        "leaves": leaves,
        "calls": int(ns.size * FLATTEN_BATCH),
        "us_per_call": float(np.median(ns)) / 1e3,
        "p10_us_per_call": float(np.percentile(ns, 10)) / 1e3,
    }


def _trees() -> dict[str, Any]:
    return {sc.name: sc.example() for sc in core_inprocess.SCENARIOS}


def steps(quick: bool) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    """The measurements in order, as (name, thunk) pairs, so a caller can show progress."""
    s = 0.3 if quick else 1.0  # seconds per measurement
    trees = _trees()
    return [
        ("memcpy", lambda: memcpy(MEMCPY_BYTES, s)),
        ("memcpy_cache", lambda: memcpy(MEMCPY_CACHE_BYTES, s)),
        ("loopback_64k", lambda: loopback(s * 1.5, core_tcp_scenarios.LOOPBACK_CHUNK)),
        ("loopback_1m", lambda: loopback(s, core_tcp_scenarios.LOOPBACK_BULK_CHUNK)),
        ("flatten_small", lambda: flatten(trees["small"], s / 2)),
        ("flatten_large", lambda: flatten(trees["large"], s / 2)),
    ]


def loopback_steps(quick: bool) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    """The loopback measurements alone (repeated after the sweep; the best one counts)."""
    return [(name, fn) for name, fn in steps(quick) if name.startswith("loopback")]
