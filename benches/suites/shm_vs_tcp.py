"""Shared memory against TCP: samples/s of the same-host shared-memory path and of TCP, same
client code, same server, interleaved.

Each round is one ``core_tcp.run_round`` (a learner reading every batch, K worker
processes sending from a common start until a common deadline, every sample checked: exactly
once, intact, in per-worker order) of the ``nest-tcp`` scenario (``shared_memory=False``) or
the ``nest-shm`` scenario (``shared_memory=True``): 40 ``float32[1224]`` leaves in 4 nested
dicts of 10 plus a ``meta`` leaf, 195,864 bytes, batch_size 64, 32 samples in flight. For
each K and repeat the two paths run back to back, their order alternating from repeat to
repeat, so a busy moment on a shared machine hits both.

The table: per K, the median over the repeats of samples/s and GB/s of each path, the median
of the per-repeat ratios shm/tcp (and their range), and the CPU per sample received (us) of
the workers and of the learner process, which show where the time goes when the machine's
cores, not a path, are the limit. Loopback and Unix sockets only.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
from typing import Any

from benches import common as c
from benches.suites import core_tcp, core_tcp_scenarios

PATHS = ("nest-tcp", "nest-shm")


def parameters(quick: bool) -> dict[str, Any]:
    if quick:
        return {"workers": [1, 4], "repeats": 1, "seconds": 1.5}
    return {"workers": [1, 4, 16], "repeats": 3, "seconds": 3.0}


def limit_s(params: dict[str, Any]) -> float:
    rounds = len(params["workers"]) * int(params["repeats"]) * len(PATHS)
    return rounds * (float(params["seconds"]) + 60.0) + 60.0


def measure(params: dict[str, Any]) -> dict[str, Any]:
    if not core_tcp_scenarios.has_shared_memory():
        raise RuntimeError("this echo has no shared-memory path")
    seconds, repeats = float(params["seconds"]), int(params["repeats"])
    opts = argparse.Namespace(count=10_000_000, warmup=0.5, seconds=seconds, grace=30.0)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "echo"])
    rounds: list[dict[str, Any]] = []
    for rep in range(repeats):
        for k in params["workers"]:
            order = PATHS if (rep + k) % 2 == 0 else PATHS[::-1]
            for name in order:
                r = core_tcp.run_round(core_tcp_scenarios.SCENARIO_BY_NAME[name], k, opts, ctx)
                rounds.append(
                    {
                        "path": name,
                        "k": k,
                        "repeat": rep,
                        **{key: r.get(key) for key in ROUND_KEYS},
                    }
                )
                print(
                    f"shm-vs-tcp: rep {rep} K={k} {name}: {r['samples_per_s']:,.0f} samples/s, "
                    f"correct {r['correct']}",
                    file=sys.stderr,
                )
    summary = []
    for k in params["workers"]:
        cell = [r for r in rounds if r["k"] == k]
        by = {n: [r for r in cell if r["path"] == n] for n in PATHS}
        ratios = []
        for rep in range(repeats):
            pair = {r["path"]: r for r in cell if r["repeat"] == rep}
            if set(pair) == set(PATHS) and pair["nest-tcp"]["samples_per_s"] > 0:
                ratios.append(pair["nest-shm"]["samples_per_s"] / pair["nest-tcp"]["samples_per_s"])

        def med(name: str, key: str, rows: dict[str, list[dict[str, Any]]] = by) -> float | None:
            vals = [float(r[key]) for r in rows[name] if r.get(key) is not None]
            return statistics.median(vals) if vals else None

        def learner_us(name: str, rows: dict[str, list[dict[str, Any]]] = by) -> float | None:
            vals = [
                r["learner_cpu_cores"] / r["samples_per_s"] * 1e6
                for r in rows[name]
                if r["samples_per_s"] and r.get("learner_cpu_cores") is not None
            ]
            return statistics.median(vals) if vals else None

        summary.append(
            {
                "k": k,
                "tcp_samples_per_s": med("nest-tcp", "samples_per_s"),
                "tcp_gbps": med("nest-tcp", "gbps"),
                "shm_samples_per_s": med("nest-shm", "samples_per_s"),
                "shm_gbps": med("nest-shm", "gbps"),
                "ratios": ratios,
                "worker_us_tcp": med("nest-tcp", "worker_cpu_us_per_sample"),
                "worker_us_shm": med("nest-shm", "worker_cpu_us_per_sample"),
                "learner_us_tcp": learner_us("nest-tcp"),
                "learner_us_shm": learner_us("nest-shm"),
                "correct": all(r["correct"] for r in cell),
            }
        )
    return {"summary": summary, "correct": all(r["correct"] for r in summary)}


ROUND_KEYS = ("samples_per_s", "gbps", "worker_cpu_us_per_sample", "learner_cpu_cores", "correct")


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    columns = [
        "echo",
        "K",
        "TCP samples/s",
        "TCP GB/s",
        "shm samples/s",
        "shm GB/s",
        "shm / TCP",
        "range",
        "worker us/sample TCP / shm",
        "learner us/sample TCP / shm",
        "correct",
    ]
    rows = c.failed_rows(results, len(columns))
    for side, r in results.items():
        for s in r.get("summary", []):
            ratios = s["ratios"]
            rows.append(
                [
                    side,
                    str(s["k"]),
                    c.num(s["tcp_samples_per_s"]),
                    c.num(s["tcp_gbps"], ".3f"),
                    c.num(s["shm_samples_per_s"]),
                    c.num(s["shm_gbps"], ".3f"),
                    c.num(statistics.median(ratios) if ratios else None, ".2f"),
                    c.span(ratios),
                    f"{c.num(s['worker_us_tcp'], '.1f')} / {c.num(s['worker_us_shm'], '.1f')}",
                    f"{c.num(s['learner_us_tcp'], '.1f')} / {c.num(s['learner_us_shm'], '.1f')}",
                    "yes" if s["correct"] else "NO",
                ]
            )
    return [
        {
            "title": f"Shared memory against TCP: ~196 KB nested samples, K worker processes, "
            f"{params['repeats']} repeat(s) of {params['seconds']:g} s (medians)",
            "columns": columns,
            "rows": rows,
        }
    ]
