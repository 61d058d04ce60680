"""Issue #14: samples/s of the same-host shared-memory path against TCP, same client code,
same server, interleaved. The issue's bar: shared memory at least 2x TCP at K = 4.

Each round is one ``bench_tcp.run_round`` (a learner here reading every batch, K worker
processes sending from a common start until a common deadline, every sample checked: exactly
once, intact, in per-worker order) of the ``nest-tcp`` scenario (``shared_memory=False``) or
the ``nest-shm`` scenario (``shared_memory=True``): issue 14's sample, 40 ``float32[1224]``
leaves in 4 nested dicts of 10 plus a ``meta`` leaf, 195,864 bytes, batch_size 64, 32 samples
in flight. For each K and repeat the two paths run back to back, their order alternating from
repeat to repeat (tcp shm, shm tcp, ...), so a busy moment on a shared machine hits both.

The table: per K, the median over the repeats of samples/s and GB/s of each path, the median
of the per-repeat ratios shm/tcp (and their range), and the CPU per sample received (µs) of
the workers and of the learner process, which show where the time goes when the machine's
cores, not a path, are the limit. Every loop is bounded in count and time (bench_tcp's
watchdogs and grace); loopback and Unix sockets only.

Usage::

    .venv/bin/python benches/tools/issue14_shm_vs_tcp.py                 # K=1,4,16, 3 repeats
    .venv/bin/python benches/tools/issue14_shm_vs_tcp.py --quick         # K=1,4, 1 repeat
    .venv/bin/python benches/tools/issue14_shm_vs_tcp.py --workers 4 --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "py"))
import bench_tcp
import helpers as h

import echo

PATHS = ("nest-tcp", "nest-shm")


def main() -> int:
    p = h.bench_parser(__doc__, "1 repeat of 1.5 s, K = 1, 4", max_seconds=1800.0)
    p.add_argument("--workers", type=h.int_list("workers", 64), default=[1, 4, 16])
    p.add_argument("--repeats", type=h.bounded_int("repeats", 50), default=3)
    p.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args()
    if args.quick:
        args.repeats, args.seconds, args.workers = 1, 1.5, [1, 4]
    if not bench_tcp.has_shared_memory():
        print("issue14: this echo has no shared-memory path", file=sys.stderr)
        return 2
    h.start_watchdog(args.max_seconds, "issue14_shm_vs_tcp")
    opts = argparse.Namespace(count=10_000_000, warmup=0.5, seconds=args.seconds, grace=30.0)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "echo"])
    label = h.default_label(args.label, echo)
    rounds: list[dict[str, Any]] = []
    load = [h.loadavg()]
    for rep in range(args.repeats):
        for k in args.workers:
            order = PATHS if (rep + k) % 2 == 0 else PATHS[::-1]
            for name in order:
                r = bench_tcp.run_round(bench_tcp.SCENARIO_BY_NAME[name], k, opts, ctx)
                r.pop("last_info", None)
                r.update(path=name, k=k, repeat=rep)
                rounds.append(r)
                print(
                    f"issue14: rep {rep} K={k} {name}: {r['samples_per_s']:,.0f} samples/s, "
                    f"{r['gbps']:.3f} GB/s, correct {r['correct']}",
                    file=sys.stderr,
                )
        load.append(h.loadavg())

    print(h.run_title(label, echo))
    print(
        f"{'K':>3} {'tcp samples/s':>14} {'tcp GB/s':>9} {'shm samples/s':>14} {'shm GB/s':>9} "
        f"{'shm/tcp':>8} {'range':>13} {'wkr us tcp/shm':>15} {'lrn us tcp/shm':>15} correct"
    )
    summary = []
    for k in args.workers:
        cell = [r for r in rounds if r["k"] == k]
        by = {n: [r for r in cell if r["path"] == n] for n in PATHS}
        ratios = []
        for rep in range(args.repeats):
            pair = {r["path"]: r for r in cell if r["repeat"] == rep}
            if set(pair) == set(PATHS) and pair["nest-tcp"]["samples_per_s"] > 0:
                ratios.append(pair["nest-shm"]["samples_per_s"] / pair["nest-tcp"]["samples_per_s"])

        def med(name: str, key: str, rows: dict[str, list[dict[str, Any]]] = by) -> float:
            vals = [float(r[key]) for r in rows[name] if r.get(key) is not None]
            return statistics.median(vals) if vals else float("nan")

        def learner_us(name: str, rows: dict[str, list[dict[str, Any]]] = by) -> float:
            vals = [
                r["learner_cpu_cores"] / r["samples_per_s"] * 1e6
                for r in rows[name]
                if r["samples_per_s"]
            ]
            return statistics.median(vals) if vals else float("nan")

        row = {
            "k": k,
            "tcp_samples_per_s": med("nest-tcp", "samples_per_s"),
            "tcp_gbps": med("nest-tcp", "gbps"),
            "shm_samples_per_s": med("nest-shm", "samples_per_s"),
            "shm_gbps": med("nest-shm", "gbps"),
            "ratio": statistics.median(ratios) if ratios else float("nan"),
            "ratio_min": min(ratios, default=float("nan")),
            "ratio_max": max(ratios, default=float("nan")),
            "worker_us_tcp": med("nest-tcp", "worker_cpu_us_per_sample"),
            "worker_us_shm": med("nest-shm", "worker_cpu_us_per_sample"),
            "learner_us_tcp": learner_us("nest-tcp"),
            "learner_us_shm": learner_us("nest-shm"),
            "correct": all(r["correct"] for r in cell),
        }
        summary.append(row)
        print(
            f"{k:>3} {row['tcp_samples_per_s']:>14,.0f} {row['tcp_gbps']:>9.3f} "
            f"{row['shm_samples_per_s']:>14,.0f} {row['shm_gbps']:>9.3f} {row['ratio']:>8.2f} "
            f"{row['ratio_min']:>6.2f}-{row['ratio_max']:<6.2f} "
            f"{row['worker_us_tcp']:>7.1f}/{row['worker_us_shm']:<7.1f} "
            f"{row['learner_us_tcp']:>7.1f}/{row['learner_us_shm']:<7.1f} {row['correct']}"
        )
    print(f"  load average (1/5/15 min) before each repeat and at the end: {load}")
    if args.json is not None:
        h.write_json(
            args.json,
            {**h.run_facts(label, echo), "summary": summary, "rounds": rounds, "load": load},
        )
    return 0 if all(r["correct"] for r in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
