"""Issue #11, finding 6 (a lock waited for with the GIL held stalls every Python thread): a
prioritized replay server (``max_size=64``, 64 items) while one thread calls
``update_priorities`` on 10M keys (``arange(10M) % 64``, uint64; float64 priorities) a few
times, the main thread calls ``server.stats()`` in a loop, and a "ticker" thread sleeps 1 ms
at a time and records its longest gap between wake-ups. The same ticker is first measured
for 1 s with nothing else running (its baseline). Reported: longest and p99 gap, each
``update_priorities`` call's duration, the ``stats()`` calls made and the slowest one.

Run under "after" and "before", interleaved; each child bounded to 60 s.

Usage::

    python benches/tools/issue11_gil_gap.py [--rounds 2] [--json /tmp/issue11-gil.json]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

import _issue11 as c

N_KEYS = 10_000_000
UPDATES = 3


def ticker(stop: threading.Event, gaps: list[float]) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


def gap_stats(gaps: list[float]) -> dict[str, float]:
    if not gaps:
        return {"max_ms": float("nan"), "p99_ms": float("nan"), "n": 0}
    s = sorted(gaps)
    return {
        "max_ms": round(s[-1] * 1e3, 2),
        "p99_ms": round(s[int(0.99 * (len(s) - 1))] * 1e3, 2),
        "n": len(s),
    }


def child(args: argparse.Namespace) -> dict[str, Any]:
    echo = c.import_echo()
    import numpy as np

    c.watchdog(55.0)
    server = echo.Server(
        {"x": np.zeros(4, np.float32)},
        batch_size=8,
        sampler=echo.Prioritized(0.6),
        max_size=64,
    )
    for i in range(64):
        server.submit({"x": np.full(4, i, np.float32)})
    keys = (np.arange(N_KEYS, dtype=np.uint64) % np.uint64(64)).astype(np.uint64)
    prios = np.random.default_rng(0).random(N_KEYS) + 0.1

    # baseline: the ticker alone for 1 s
    stop = threading.Event()
    base: list[float] = []
    t = threading.Thread(target=ticker, args=(stop, base), daemon=True)
    t.start()
    time.sleep(1.0)
    stop.set()
    t.join()

    durations: list[float] = []
    done = threading.Event()

    def updater() -> None:
        try:
            for _ in range(UPDATES):
                t0 = time.perf_counter()
                server.update_priorities(keys, prios)
                durations.append(time.perf_counter() - t0)
        finally:
            done.set()

    stop = threading.Event()
    gaps: list[float] = []
    tk = threading.Thread(target=ticker, args=(stop, gaps), daemon=True)
    tk.start()
    time.sleep(0.05)
    up = threading.Thread(target=updater, daemon=True)
    up.start()
    calls = 0
    slowest = 0.0
    while not done.is_set():
        t0 = time.perf_counter()
        server.stats()
        slowest = max(slowest, time.perf_counter() - t0)
        calls += 1
    up.join()
    stop.set()
    tk.join()
    st = server.stats()
    server.close()
    return {
        **c.echo_facts(echo),
        "switch_interval_ms": sys.getswitchinterval() * 1e3,
        "baseline": gap_stats(base),
        "loaded": gap_stats(gaps),
        "update_s": [round(d, 3) for d in durations],
        "stats_calls": calls,
        "stats_slowest_ms": round(slowest * 1e3, 2),
        "priority_updates_total": st.priority_updates_total,
    }


def report(results: list[dict[str, Any]]) -> None:
    print(
        f"# finding 6: ticker's longest gap between 1 ms sleeps while update_priorities"
        f" ({N_KEYS // 1_000_000}M keys, x{UPDATES}) runs and the main thread loops on stats()"
    )
    print(
        f"{'side':8} {'round':>5} {'idle max':>8} {'max gap':>8} {'p99 gap':>8}"
        f" {'update s (each)':>20} {'stats calls':>11} {'slowest stats':>13} {'load1':>6}"
    )
    for d in results:
        if "loaded" not in d:
            print(f"{d['side']:8} error: {d.get('error')} {d.get('stderr_tail', '')[-300:]}")
            continue
        print(
            f"{d['side']:8} {d['round']:>5} {d['baseline']['max_ms']:>6.1f}ms"
            f" {d['loaded']['max_ms']:>6.1f}ms {d['loaded']['p99_ms']:>6.1f}ms"
            f" {', '.join(f'{x:.2f}' for x in d['update_s']):>20} {d['stats_calls']:>11}"
            f" {d['stats_slowest_ms']:>11.1f}ms {d['load_start'][0]:>6.2f}"
        )


if __name__ == "__main__":
    sys.exit(c.main("gil", child, report, default_rounds=2, child_timeout=60.0))
