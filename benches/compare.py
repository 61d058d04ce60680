"""Ratios between two result files of the same benchmark script: ``core_inprocess.py --json``
(per scenario) or ``core_tcp.py --json`` (per scenario and worker count K). Which of the two
a file is, is read from the file (a TCP result records its ``workers``).

Usage: ``python -m benches.compare a.json b.json`` (A is usually ours, B the peer).
Every ratio is A / B: above 1 is better for throughput metrics (samples/s, GB/s: higher is
better), below 1 is better for the latencies (``sample()`` in-process, send to ``sample()``
over TCP: lower is better). Runs that were not ``correct`` are flagged. ``python -m benches``
computes its ratios with :func:`inprocess_ratio_rows` and :func:`tcp_ratio_rows`. Stdlib only.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# (label, path into a result dict, higher_is_better)
Metric = tuple[str, tuple[str, ...], bool]

INPROCESS_METRICS: tuple[Metric, ...] = (
    ("samples/s", ("samples_per_s",), True),
    ("GB/s", ("gbps",), True),
    ("frac of memcpy", ("frac_of_memcpy",), True),
    ("sample() p50 us", ("sample_overhead", "p50_us"), False),
    ("sample() p99 us", ("sample_overhead", "p99_us"), False),
    ("sample() mean us", ("sample_overhead", "mean_us"), False),
    ("memcpy GB/s (ref)", ("memcpy_gbps",), True),
)
TCP_METRICS: tuple[Metric, ...] = (
    ("samples/s", ("samples_per_s",), True),
    ("GB/s", ("gbps",), True),
    ("p50 ms", ("p50_ms",), False),
    ("p99 ms", ("p99_ms",), False),
)
# the run parameters that should match between A and B
SAME: tuple[str, ...] = ("cpu", "python", "numpy", "seconds", "quick")

Row = tuple[Any, ...]  # (*ids, metric, A, B, A/B, higher_is_better)


def number(d: Any, path: tuple[str, ...]) -> float:
    """The number at ``path`` in nested dicts, NaN where it is missing or not a number."""
    cur: Any = d
    for key in path:
        if not isinstance(cur, dict) or key not in cur:
            return math.nan
        cur = cur[key]
    return float(cur) if isinstance(cur, (int, float)) else math.nan


def _both(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The keys of ``a`` that ``b`` has too, in ``a``'s order."""
    return [k for k in a if k in b]


def _rows(
    pairs: Iterable[tuple[tuple[str, ...], dict[str, Any], dict[str, Any]]],
    metrics: tuple[Metric, ...],
) -> list[Row]:
    """(*ids, metric, A, B, A/B, higher_is_better) for each (ids, A, B) and metric."""
    rows: list[Row] = []
    for ids, ra, rb in pairs:
        for label, path, higher in metrics:
            va, vb = number(ra, path), number(rb, path)
            rows.append((*ids, label, va, vb, va / vb if vb else math.nan, higher))
    return rows


def inprocess_ratio_rows(sa: dict[str, Any], sb: dict[str, Any]) -> list[Row]:
    """(scenario, metric, A, B, A/B, higher_is_better) for the scenarios in both A and B."""
    pairs = (((name,), sa[name], sb[name]) for name in _both(sa, sb))
    return _rows(pairs, INPROCESS_METRICS)


def tcp_ratio_rows(sa: dict[str, Any], sb: dict[str, Any]) -> list[Row]:
    """(scenario, K, metric, A, B, A/B, higher_is_better) for the rounds in both A and B."""
    pairs = (
        ((name, k), sa[name][k], sb[name][k])
        for name in _both(sa, sb)
        for k in _both(sa[name], sb[name])
    )
    return _rows(pairs, TCP_METRICS)


def _better(higher: bool) -> str:
    return "higher" if higher else "lower"


def _print_inprocess(sa: dict[str, Any], sb: dict[str, Any]) -> None:
    print(f"{'scenario':<8} {'metric':<18} {'A':>12} {'B':>12} {'A/B':>8}  better")
    rows = inprocess_ratio_rows(sa, sb)
    for name in _both(sa, sb):
        for _, label, va, vb, ratio, higher in (r for r in rows if r[0] == name):
            print(f"{name:<8} {label:<18} {va:>12.4g} {vb:>12.4g} {ratio:>8.3f}  {_better(higher)}")
        for side, s in (("A", sa[name]), ("B", sb[name])):
            if not s.get("correct", False) or s.get("truncated", False):
                print(
                    f"{name:<8} warning: {side} correct={s.get('correct')} "
                    f"truncated={s.get('truncated')}"
                )


def _print_tcp(
    a: dict[str, Any], b: dict[str, Any], sa: dict[str, Any], sb: dict[str, Any]
) -> None:
    la, lb = a.get("loopback") or {}, b.get("loopback") or {}
    ga, gb = number(la, ("gbps",)), number(lb, ("gbps",))
    ba, bb = number(la, ("bulk_1mib", "gbps")), number(lb, ("bulk_1mib", "gbps"))
    print(
        f"raw loopback GB/s (64 KiB sendall): A {ga:.2f}, B {gb:.2f}; (1 MiB): A {ba:.2f}, "
        f"B {bb:.2f} (each run measures its own)"
    )
    print(
        f"{'scenario':<8} {'K':>4} {'metric':<10} {'A':>11} {'B':>11} {'A/B':>7}  better"
        "   (correct A/B)"
    )
    for name in _both(sa, sb):
        for k in _both(sa[name], sb[name]):
            ra, rb = sa[name][k], sb[name][k]
            flag = f"   ({ra.get('correct')}/{rb.get('correct')})"
            for _, _, label, va, vb, ratio, higher in tcp_ratio_rows(
                {name: {k: ra}}, {name: {k: rb}}
            ):
                print(
                    f"{name:<8} {k:>4} {label:<10} {va:>11.4g} {vb:>11.4g} {ratio:>7.3f}  "
                    f"{_better(higher):<6}{flag}"
                )
                flag = ""
            if name == "large":
                for label, key in (
                    ("frac loop", "frac_loopback"),
                    ("frac 1MiB", "frac_loopback_1mib"),
                ):
                    fa, fb = number(ra, (key,)), number(rb, (key,))
                    print(f"{name:<8} {k:>4} {label:<10} {fa:>11.3f} {fb:>11.3f}")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    a, b = (json.loads(Path(p).read_text(encoding="utf-8")) for p in argv)
    tcp = "workers" in a
    if tcp != ("workers" in b):
        print("compare: one file is a core_tcp.py result, the other is not", file=sys.stderr)
        return 2
    for side, doc in (("A", a), ("B", b)):
        print(
            f"{side} = {doc.get('label', side)} (echo {doc.get('echo_version')}, "
            f"commit {doc.get('commit')})"
        )
    for key in SAME:
        if a.get(key) != b.get(key):
            print(f"warning: {key} differs: {a.get(key)!r} vs {b.get(key)!r}")
    sa, sb = a.get("scenarios", {}), b.get("scenarios", {})
    if tcp:
        _print_tcp(a, b, sa, sb)
    else:
        _print_inprocess(sa, sb)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
