"""Issue #10 (no performance regression): re-runs one scenario of ``python -m benches`` with
two interpreters, several times, interleaved (A B, B A, A B, ...), to tell a ratio below 1
from noise on a loaded machine.

Besides throughput (samples/s, which another process's load moves a lot) it reports the CPU
each side spends per sample, which load moves much less: for the in-process scenarios the
child process's user + system CPU time (``getrusage(RUSAGE_CHILDREN)``; the scenario does a
fixed amount of work), for TCP the learner's CPU per sample (``learner_cpu_cores`` over the
window) and the workers' (``worker_cpu_us_per_sample``). Runs ``benches/py/bench_inprocess.py``
or ``benches/py/bench_tcp.py`` as ``python -m benches`` does; each child under a timeout, in
its own process group, and no run starts after ``--max-seconds``.

Usage::

    python benches/tools/issue10_rerun.py inprocess --only small --pairs 4
    python benches/tools/issue10_rerun.py tcp --only large --workers 1,4 --pairs 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPTS = ROOT / "benches" / "py"


def run_one(
    kind: str, python: str, label: str, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    if kind == "inprocess":
        cmd = [python, str(SCRIPTS / "bench_inprocess.py"), f"--only={args.only}"]
        cmd += ["--max-seconds=100"]
    else:
        cmd = [python, str(SCRIPTS / "bench_tcp.py"), f"--only={args.only}"]
        cmd += [f"--workers={args.workers}", f"--seconds={args.seconds}", "--launcher=process"]
        cmd += ["--loopback-seconds=0", "--max-seconds=150"]
    cmd += [f"--label={label}", f"--json={out}"]
    load = os.getloadavg()[0]
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        rc = proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return {"label": label, "error": "timed out"}
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    res: dict[str, Any] = {
        "label": label,
        "rc": rc,
        "load1": round(load, 2),
        "wall_s": round(time.monotonic() - t0, 2),
    }
    try:
        doc = json.loads(out.read_text())
    except (OSError, json.JSONDecodeError) as e:
        res["error"] = f"no JSON: {e}"
        return res
    sc = doc["scenarios"][args.only]
    if kind == "inprocess":
        res["samples_per_s"] = sc["samples_per_s"]
        res["cpu_s"] = round(cpu, 3)
        res["cpu_us_per_sample"] = cpu / sc["n_delivered"] * 1e6
    else:
        for k, r in sc.items():
            n = r.get("samples_in_window") or 0
            res[f"K={k}"] = {
                "samples_per_s": r.get("samples_per_s"),
                "learner_us_per_sample": (
                    r["learner_cpu_cores"] * r["window_s"] / n * 1e6
                    if n and r.get("learner_cpu_cores") is not None
                    else None
                ),
                "worker_us_per_sample": r.get("worker_cpu_us_per_sample"),
            }
    return res


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(runs: list[dict[str, Any]], metrics: list[tuple[str, str, bool]]) -> None:
    """metrics: (path, name, higher_is_better); path is 'key' or 'K=4/key'."""

    def get(r: dict[str, Any], path: str) -> float | None:
        cur: Any = r
        for part in path.split("/"):
            if not isinstance(cur, dict) or part not in cur:
                return None
            cur = cur[part]
        return cur if isinstance(cur, (int, float)) else None

    print(f"{'metric':34} {'A median':>10} {'B median':>10} {'A/B':>6}  per-run A | B")
    for path, name, _ in metrics:
        a = [v for r in runs if r["label"] == "A" and (v := get(r, path)) is not None]
        b = [v for r in runs if r["label"] == "B" and (v := get(r, path)) is not None]
        ma, mb = med(a), med(b)
        print(
            f"{name:34} {ma:>10.4g} {mb:>10.4g} {ma / mb if mb else float('nan'):>6.2f}"
            f"  {' '.join(f'{x:.4g}' for x in a)} | {' '.join(f'{x:.4g}' for x in b)}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("kind", choices=("inprocess", "tcp"))
    ap.add_argument("--only", choices=("small", "large"), required=True)
    ap.add_argument("--workers", default="1,4,16", help="TCP worker counts")
    ap.add_argument("--seconds", type=float, default=4.0, help="TCP window per K")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--a", default="/work/main/.venv/bin/python", help="A: after")
    ap.add_argument("--b", default="/work/before/venv/bin/python", help="B: before")
    ap.add_argument("--max-seconds", type=float, default=300.0)
    ap.add_argument("--json", default=None, help="write every run here")
    args = ap.parse_args()
    t_end = time.monotonic() + args.max_seconds
    runs: list[dict[str, Any]] = []
    print(f"# {args.kind} {args.only}: A={args.a} B={args.b}; load {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="issue10-rerun-") as tmp:
        for i in range(args.pairs):
            for label in ("A", "B") if i % 2 == 0 else ("B", "A"):
                if time.monotonic() > t_end:
                    print("# --max-seconds reached; stopping")
                    break
                python = args.a if label == "A" else args.b
                out = Path(tmp) / f"{i}-{label}.json"
                r = run_one(args.kind, python, label, args, out)
                runs.append(r)
                print(f"  {json.dumps(r)}", flush=True)
    if args.kind == "inprocess":
        metrics = [
            ("samples_per_s", "samples/s", True),
            ("cpu_us_per_sample", "process CPU us/sample", False),
        ]
    else:
        metrics = []
        for k in args.workers.split(","):
            metrics += [
                (f"K={k}/samples_per_s", f"K={k} samples/s", True),
                (f"K={k}/learner_us_per_sample", f"K={k} learner CPU us/sample", False),
                (f"K={k}/worker_us_per_sample", f"K={k} worker CPU us/sample", False),
            ]
    summarize(runs, metrics)
    print(f"# load at end {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
