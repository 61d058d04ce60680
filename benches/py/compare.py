"""Print ratios between two ``bench_inprocess.py --json`` results.

Usage: ``python benches/py/compare.py a.json b.json`` (A is usually ours, B the peer).
Every ratio is A / B: above 1 is better for throughput metrics (higher is better), below 1 is
better for the ``sample()`` latency metrics (lower is better). Stdlib only.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

# (label, path into a scenario dict, higher_is_better)
METRICS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("samples/s", ("samples_per_s",), True),
    ("GB/s", ("gbps",), True),
    ("frac of memcpy", ("frac_of_memcpy",), True),
    ("sample() p50 us", ("sample_overhead", "p50_us"), False),
    ("sample() p99 us", ("sample_overhead", "p99_us"), False),
    ("sample() mean us", ("sample_overhead", "mean_us"), False),
    ("memcpy GB/s (ref)", ("memcpy_gbps",), True),
)


def _get(d: dict[str, Any], path: tuple[str, ...]) -> float:
    cur: Any = d
    for key in path:
        if not isinstance(cur, dict) or key not in cur:
            return math.nan
        cur = cur[key]
    return float(cur) if isinstance(cur, (int, float)) else math.nan


def ratio_rows(
    sa: dict[str, Any], sb: dict[str, Any]
) -> list[tuple[str, str, float, float, float, bool]]:
    """(scenario, metric, A, B, A/B, higher_is_better) for the scenarios in both A and B."""
    rows: list[tuple[str, str, float, float, float, bool]] = []
    for name in (n for n in sa if n in sb):
        for label, path, higher in METRICS:
            va, vb = _get(sa[name], path), _get(sb[name], path)
            rows.append((name, label, va, vb, va / vb if vb else math.nan, higher))
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    a, b = (json.loads(Path(p).read_text(encoding="utf-8")) for p in argv)
    la, lb = a.get("label", "A"), b.get("label", "B")
    print(f"A = {la} (echo {a.get('echo_version')}, commit {a.get('commit')})")
    print(f"B = {lb} (echo {b.get('echo_version')}, commit {b.get('commit')})")
    for key in ("cpu", "python", "numpy", "quick"):
        if a.get(key) != b.get(key):
            print(f"warning: {key} differs: {a.get(key)!r} vs {b.get(key)!r}")

    sa, sb = a.get("scenarios", {}), b.get("scenarios", {})
    print(f"{'scenario':<8} {'metric':<18} {'A':>12} {'B':>12} {'A/B':>8}  better")
    rows = ratio_rows(sa, sb)
    for name in (n for n in sa if n in sb):
        for _, label, va, vb, ratio, higher in (r for r in rows if r[0] == name):
            print(
                f"{name:<8} {label:<18} {va:>12.4g} {vb:>12.4g} {ratio:>8.3f}  "
                f"{'higher' if higher else 'lower'}"
            )
        for side, s in (("A", sa[name]), ("B", sb[name])):
            if not s.get("correct", False) or s.get("truncated", False):
                print(
                    f"{name:<8} warning: {side} correct={s.get('correct')} "
                    f"truncated={s.get('truncated')}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
