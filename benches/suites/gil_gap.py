"""GIL gap: the longest stall of a Python thread while ``update_priorities`` holds the replay
table's lock.

A prioritized replay server (``max_size=64``, 64 items); one thread calls
``update_priorities`` on ``keys`` keys (``arange(keys) % 64``) ``updates`` times, the main
thread calls ``server.stats()`` in a loop (it needs the same lock), and a ticker thread
sleeps 1 ms at a time and records its gaps between wake-ups. The ticker alone, for 1 s
first, is the baseline. A lock waited for with the GIL held would freeze the ticker for the
whole update; echo waits with the GIL released.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from benches import common as c


def parameters(quick: bool) -> dict[str, Any]:
    return {"keys": 2_000_000 if quick else 10_000_000, "updates": 3}


def limit_s(params: dict[str, Any]) -> float:
    return 90.0


def _ticker(stop: threading.Event, gaps: list[float]) -> None:
    last = time.perf_counter()
    for _ in range(10_000_000):
        if stop.is_set():
            return
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


def _gap_stats(gaps: list[float]) -> dict[str, float]:
    return {
        "max_ms": round(max(gaps, default=float("nan")) * 1e3, 2),
        "p99_ms": round(c.percentile(gaps, 99) * 1e3, 2),
        "n": len(gaps),
    }


def measure(params: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    import echo

    c.watchdog(limit_s(params))
    n_keys, updates = int(params["keys"]), int(params["updates"])
    server = echo.Server(
        {"x": np.zeros(4, np.float32)}, batch_size=8, sampler=echo.Prioritized(0.6), max_size=64
    )
    for i in range(64):
        server.submit({"x": np.full(4, i, np.float32)})
    keys = np.arange(n_keys, dtype=np.uint64) % np.uint64(64)
    priorities = np.random.default_rng(0).random(n_keys) + 0.1

    stop = threading.Event()
    base: list[float] = []
    t = threading.Thread(target=_ticker, args=(stop, base), daemon=True)
    t.start()
    time.sleep(1.0)
    stop.set()
    t.join()

    durations: list[float] = []
    done = threading.Event()

    def updater() -> None:
        try:
            for _ in range(updates):
                t0 = time.perf_counter()
                server.update_priorities(keys, priorities)
                durations.append(time.perf_counter() - t0)
        finally:
            done.set()

    stop = threading.Event()
    gaps: list[float] = []
    ticker = threading.Thread(target=_ticker, args=(stop, gaps), daemon=True)
    ticker.start()
    up = threading.Thread(target=updater, daemon=True)
    up.start()
    calls, slowest = 0, 0.0
    deadline = time.monotonic() + limit_s(params) - 10
    while not done.is_set() and time.monotonic() < deadline:
        t0 = time.perf_counter()
        server.stats()
        slowest = max(slowest, time.perf_counter() - t0)
        calls += 1
    up.join(10.0)
    stop.set()
    ticker.join()
    updated = server.stats().priority_updates_total
    server.close()
    return {
        "switch_interval_ms": sys.getswitchinterval() * 1e3,
        "baseline": _gap_stats(base),
        "loaded": _gap_stats(gaps),
        "update_s": [round(d, 3) for d in durations],
        "stats_calls": calls,
        "stats_slowest_ms": round(slowest * 1e3, 2),
        "correct": updated == updates * n_keys,
    }


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    columns = [
        "echo",
        "ticker alone: longest gap",
        "during updates: longest gap",
        "p99 gap",
        "one update_priorities",
        "stats() calls meanwhile",
        "slowest stats()",
    ]
    rows = c.failed_rows(results, len(columns))
    for side, r in results.items():
        if "error" in r:
            continue
        rows.append(
            [
                side,
                f"{r['baseline']['max_ms']:.1f} ms",
                f"{r['loaded']['max_ms']:.1f} ms",
                f"{r['loaded']['p99_ms']:.1f} ms",
                f"{c.median(r['update_s']):.2f} s",
                f"{r['stats_calls']:,}",
                f"{r['stats_slowest_ms']:.1f} ms",
            ]
        )
    return [
        {
            "title": f"A 1 ms ticker thread while update_priorities({params['keys']:,} keys) "
            f"runs {params['updates']} times and the main thread loops on stats()",
            "columns": columns,
            "rows": rows,
        }
    ]
