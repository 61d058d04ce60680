"""Issue #10 (no performance regression): the after/before throughput ratios of several
``python -m benches --compare`` runs side by side, with each run's load average, commit and
our ``_echo`` build, and the geometric mean and range of each ratio over the runs.

On a small, shared machine one run's ratio is mostly noise (the load average moves by a
factor of three within a run); the spread over runs is what tells a regression from noise.
Reads only the runs' ``results.json``; changes nothing.

Usage::

    python benches/tools/issue10_ratios.py /tmp/bench-10 /tmp/bench-10b [...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from pathlib import Path
from typing import Any


def rows(doc: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """(ours, other) samples/s per scenario of one run."""
    out: dict[str, tuple[float, float]] = {}
    ip = doc.get("inprocess", {})
    for sc in ("small", "large"):
        with contextlib.suppress(KeyError, TypeError):
            out[f"in-process {sc}"] = (
                ip["ours"][sc]["samples_per_s"],
                ip["other"][sc]["samples_per_s"],
            )
    tcp = doc.get("tcp", {})
    for sc in ("small", "large"):
        ks = sorted(
            set(tcp.get("ours", {}).get(sc, {})) & set(tcp.get("other", {}).get(sc, {})), key=int
        )
        for k in ks:
            with contextlib.suppress(KeyError, TypeError):
                out[f"TCP {sc} K={k}"] = (
                    tcp["ours"][sc][k]["samples_per_s"],
                    tcp["other"][sc][k]["samples_per_s"],
                )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("runs", nargs="+", help="output folders of python -m benches --compare")
    args = ap.parse_args()
    docs = []
    for run in args.runs:
        path = Path(run) / "results.json"
        docs.append((Path(run).name, json.loads(path.read_text())))
    print("# runs")
    for run, (name, d) in zip(args.runs, docs, strict=True):
        m = d.get("machine", {})
        la_b = [round(x, 1) for x in (m.get("loadavg_before") or [])]
        la_a = [round(x, 1) for x in (m.get("loadavg_after") or [])]
        builds = sorted(
            {
                str(b.get("sha256", "?"))[:12]
                for raw in (Path(run) / "raw").glob("tcp-*-ours.json")
                for b in (json.loads(raw.read_text()).get("echo_build") or [])
            }
        )
        build = f", ours build {', '.join(builds)}" if builds else ""
        print(
            f"  {name}: started {d.get('started')}, commit {str(d.get('commit'))[:10]}"
            f"{' (dirty)' if d.get('commit_dirty') else ''}, load before {la_b} after {la_a},"
            f" wall {d.get('wall_s', 0):.0f} s{build}"
        )
    per_run = [rows(d) for _, d in docs]
    keys: list[str] = []
    for r in per_run:
        keys += [k for k in r if k not in keys]
    width = max(8, *(len(n) for n, _ in docs))
    print("\n# samples/s ratio after/before (above 1: after is faster)")
    print(
        f"{'scenario':18} "
        + " ".join(f"{n:>{width}}" for n, _ in docs)
        + f" {'geomean':>8} {'min':>6} {'max':>6}"
    )
    for k in keys:
        ratios = [r[k][0] / r[k][1] if k in r and r[k][1] else None for r in per_run]
        got = [x for x in ratios if x]
        gm = math.exp(sum(math.log(x) for x in got) / len(got)) if got else float("nan")
        cells = " ".join(f"{x:>{width}.2f}" if x else f"{'-':>{width}}" for x in ratios)
        print(
            f"{k:18} {cells} {gm:>8.2f} {min(got, default=math.nan):>6.2f}"
            f" {max(got, default=math.nan):>6.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
