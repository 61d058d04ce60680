"""Print ratios between two ``bench_tcp.py --json`` results, per scenario and worker count K.

Usage: ``python benches/py/compare_tcp.py a.json b.json`` (A is usually ours, B the peer).
Every ratio is A / B: above 1 is better for samples/s and GB/s, below 1 is better for the
latencies. Rounds that were not ``correct`` are flagged. Stdlib only.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

# (label, key, higher_is_better)
METRICS: tuple[tuple[str, str, bool], ...] = (
    ("samples/s", "samples_per_s", True),
    ("GB/s", "gbps", True),
    ("p50 ms", "p50_ms", False),
    ("p99 ms", "p99_ms", False),
)


def _num(d: dict[str, Any], key: str) -> float:
    v = d.get(key)
    return float(v) if isinstance(v, (int, float)) else math.nan


def ratio_rows(
    sa: dict[str, Any], sb: dict[str, Any]
) -> list[tuple[str, str, str, float, float, float, bool]]:
    """(scenario, K, metric, A, B, A/B, higher_is_better) for the rounds in both A and B."""
    rows: list[tuple[str, str, str, float, float, float, bool]] = []
    for name in (n for n in sa if n in sb):
        for k in (k for k in sa[name] if k in sb[name]):
            for label, key, higher in METRICS:
                va, vb = _num(sa[name][k], key), _num(sb[name][k], key)
                rows.append((name, k, label, va, vb, va / vb if vb else math.nan, higher))
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    a, b = (json.loads(Path(p).read_text(encoding="utf-8")) for p in argv)
    print(f"A = {a.get('label')} (echo {a.get('echo_version')}, commit {a.get('commit')})")
    print(f"B = {b.get('label')} (echo {b.get('echo_version')}, commit {b.get('commit')})")
    for key in ("cpu", "python", "numpy", "seconds", "quick"):
        if a.get(key) != b.get(key):
            print(f"warning: {key} differs: {a.get(key)!r} vs {b.get(key)!r}")
    la, lb = a.get("loopback", {}), b.get("loopback", {})
    ga, gb = _num(la, "gbps"), _num(lb, "gbps")
    ba, bb = _num(la.get("bulk_1mib", {}), "gbps"), _num(lb.get("bulk_1mib", {}), "gbps")
    print(
        f"raw loopback GB/s (64 KiB sendall): A {ga:.2f}, B {gb:.2f}; (1 MiB): A {ba:.2f}, "
        f"B {bb:.2f} (each run measures its own)"
    )
    print(
        f"{'scenario':<8} {'K':>4} {'metric':<10} {'A':>11} {'B':>11} {'A/B':>7}  better"
        "   (correct A/B)"
    )
    sa, sb = a.get("scenarios", {}), b.get("scenarios", {})
    for name in (n for n in sa if n in sb):
        for k in (k for k in sa[name] if k in sb[name]):
            ra, rb = sa[name][k], sb[name][k]
            flag = f"   ({ra.get('correct')}/{rb.get('correct')})"
            for _, _, label, va, vb, ratio, higher in ratio_rows({name: {k: ra}}, {name: {k: rb}}):
                print(
                    f"{name:<8} {k:>4} {label:<10} {va:>11.4g} {vb:>11.4g} {ratio:>7.3f}  "
                    f"{'higher' if higher else 'lower '}{flag}"
                )
                flag = ""
            if name == "large":
                for label, key in (
                    ("frac loop", "frac_loopback"),
                    ("frac 1MiB", "frac_loopback_1mib"),
                ):
                    fa, fb = _num(ra, key), _num(rb, key)
                    print(f"{name:<8} {k:>4} {label:<10} {fa:>11.3f} {fb:>11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
