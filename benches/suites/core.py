"""The ``core`` suite of ``python -m benches`` (the default; :mod:`benches.front` runs it): the
machine's raw limits, the in-process scenarios and the TCP actor sweep in one session, as
JSON, PNG plots and a summary table.

Usage::

    python -m benches [core] [--quick] [--out DIR] [--label NAME] [--compare PYTHON]
                      [--workers 1,4,16,64] [--seconds S] [--launcher process|ray]

Each scenario runs in a child process of the interpreter under test: ``python -m
benches.suites.core_inprocess``, ``core_views`` (``sample()`` on a complete batch of 1, 10 and
40 leaves: the cost of building the numpy views) or ``core_tcp``, as their own command lines
run them. That keeps their watchdogs (which end their process) away from this one, keeps the
progress bars out of the measured process, and treats the two sides of a comparison alike: with
``--compare PYTHON`` each scenario runs with our interpreter and with ``PYTHON``, one right
after the other, the first of the pair alternating from scenario to scenario (ours first,
then the other first, ...), so that a drift in the machine's speed does not favour one side.
Ratios are ours / other, computed with :mod:`benches.compare`.

The TCP sweep's workers are local processes (``--launcher process``, the default, nothing
to install) or Ray actors in a local Ray instance (``--launcher ray``, with the
``distributed`` extra: ``pip install 'id-echo[distributed]'``; every interpreter under test
needs it, which is checked before anything runs); either way the learner's server is in
``core_tcp``'s own process and the workers connect to it over 127.0.0.1. Worker counts
default to 1, 4, 16, 64 and go up to 1,000 (``--workers``).

The raw limits are measured once, in this process, before the scenarios; the loopback
blast is repeated after the TCP sweep (not with ``--quick``) and the faster measurement is
the reference for ``frac_loopback``. Everything is bounded: each child runs under its own
``--max-seconds`` watchdog and is ended (its process group: it and the workers it started)
15 s past it, and no child starts after ``--max-seconds`` of the whole session.

Writes ``DIR/results.json`` (commit, machine, interpreters and echo builds, parameters,
every number), ``DIR/summary.txt``, the children's JSON in ``DIR/raw/`` and their output in
``DIR/logs/``, and ``DIR/tcp-throughput.png`` and ``DIR/tcp-latency.png`` where matplotlib is
importable. Exit status 0 when every scenario of ours ran and was ``correct``, 1 otherwise
(the other side's failures are reported, not fatal), 2 for a bad invocation.

This module holds the session (planning the steps, running each in a child, collecting the
results); the summary and record tables are in :mod:`benches.suites.core_tables`, the
child-process runner in :mod:`benches.runner`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benches import common as h
from benches import compare, limits, plots
from benches.runner import KILL_GRACE_S, Progress, run_child, tqdm_missing
from benches.suites import (
    core_tcp,
    core_tcp_scenarios,
    core_tcp_workers,
    core_views,
)
from benches.suites.core_tables import (
    OURS_ONLY,
    SCENARIO_NAMES,
    SIDES,
    TCP_EXTRA,
    summary,
    tables,
)

__all__ = ["main", "tables"]  # what benches.front calls

ROOT = h.ROOT
DEFAULT_WORKERS = (1, 4, 16, 64)
QUICK_WORKERS = (1, 4)
TCP_WARMUP_S = 0.5  # bench_tcp's default
TCP_GRACE_S = 30.0  # bench_tcp's default
TCP_LINE = re.compile(r"^bench_tcp: ([\w-]+) K=(\d+): (.*)$")
PROBE = (
    "import importlib.util, json, platform, sys, numpy, echo; print(json.dumps({'executable':"
    " sys.executable, 'python_version': platform.python_version(), 'numpy': numpy.__version__,"
    " 'echo_version': getattr(echo, '__version__', None), 'echo_path': echo.__file__,"
    " 'ray': importlib.util.find_spec('ray') is not None}))"
)
RAY_INIT_S = 60.0  # allowance for starting (and stopping) the local Ray instance


# --------------------------------------------------------------------------- machine, interpreters


def machine_info() -> dict[str, Any]:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    mem_kib = h.proc_kib("/proc/meminfo", "MemTotal").get("MemTotal")
    return {
        "cpu": h.cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": affinity,
        "memory_gib": mem_kib / 1024**2 if mem_kib else None,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "loadavg_before": os.getloadavg(),
    }


def probe(python: str) -> dict[str, Any]:
    """Which echo, numpy and Python an interpreter has (raises RuntimeError if it has none)."""
    try:
        out = subprocess.run(
            [python, "-c", PROBE],
            cwd=ROOT,  # as the scripts run: python -m benches.suites.NAME from the root
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"{python}: {e}") from e
    if out.returncode != 0:
        raise RuntimeError(f"{python} cannot import numpy and echo:\n{out.stderr.strip()}")
    info: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return info


# --------------------------------------------------------------------------- child processes


@dataclass(frozen=True)
class Step:
    kind: str  # "inprocess", "views" or "tcp"
    scenario: str
    side: str  # "ours" or "other"
    python: str
    label: str

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.scenario}-{self.side}"


def _tcp_limit_s(ks: list[int], seconds: float, launcher: str) -> float:
    """bench_tcp's worst case: per round the setup timeout, window, grace and joins; with
    Ray, starting the local instance."""
    per_round = sum(
        core_tcp.setup_timeout_s(launcher, k) + TCP_WARMUP_S + seconds + TCP_GRACE_S + 20.0
        for k in ks
    )
    return per_round + (RAY_INIT_S if launcher == "ray" else 0.0)


def step_command(
    step: Step, out: Path, quick: bool, ks: list[int], seconds: float, launcher: str = "process"
) -> tuple[list[str], Path, float]:
    """(command line, JSON path, the child's own --max-seconds) for one step."""
    json_path = out / "raw" / f"{step.name}.json"
    if step.kind == "inprocess":
        limit = 60.0 if quick else 300.0
        cmd = [
            step.python,
            "-m",
            "benches.suites.core_inprocess",
            *(["--quick"] if quick else []),
            f"--only={step.scenario}",
            f"--label={step.label}",
            f"--json={json_path}",
            f"--max-seconds={limit:.0f}",
        ]
    elif step.kind == "views":
        limit = 60.0
        cmd = [
            step.python,
            "-m",
            "benches.suites.core_views",
            *(["--quick"] if quick else []),
            f"--label={step.label}",
            f"--json={json_path}",
            f"--max-seconds={limit:.0f}",
        ]
    else:
        limit = _tcp_limit_s(ks, seconds, launcher)
        cmd = [
            step.python,
            "-m",
            "benches.suites.core_tcp",
            *(["--quick"] if quick else []),
            f"--only={step.scenario}",
            f"--workers={','.join(str(k) for k in ks)}",
            f"--seconds={seconds:g}",
            f"--launcher={launcher}",
            "--loopback-seconds=0",  # measured once for the session, in raw limits
            f"--label={step.label}",
            f"--json={json_path}",
            f"--max-seconds={limit:.0f}",
        ]
    return cmd, json_path, limit


# --------------------------------------------------------------------------- the session


@dataclass
class Session:
    args: argparse.Namespace
    out: Path
    ks: list[int]
    seconds: float
    progress: Progress
    deadline: float
    doc: dict[str, Any]

    def run_step(self, step: Step, overall: Any) -> None:
        quick: bool = self.args.quick
        cmd, json_path, limit = step_command(
            step, self.out, quick, self.ks, self.seconds, self.args.launcher
        )
        record: dict[str, Any] = {"step": step.name, "python": step.python, "cmd": cmd}
        self.doc["steps"].append(record)
        left = self.deadline - time.monotonic()
        if left < 5.0:
            record["skipped"] = "over --max-seconds"
            self.progress.say(f"benches: {step.name}: skipped, over --max-seconds")
            overall.update(1)
            return
        overall.set_postfix_str(step.name)
        is_tcp = step.kind == "tcp"
        bar = self.progress.bar(
            total=len(self.ks) if is_tcp else 1,
            desc=f"{step.kind} {step.scenario} [{step.label}]",
            unit="round" if is_tcp else "scenario",
            position=1,
            leave=False,
        )
        say = self.progress.say

        def on_line(stream: str, line: str) -> None:
            m = TCP_LINE.match(line) if stream == "err" else None
            if m is None:
                return
            k, rest = m.group(2), m.group(3)
            if "samples/s" in rest:
                bar.update(1)
                bar.set_postfix_str(f"K={k}: {rest.split(', p50')[0]}")
                say(f"  {step.scenario} [{step.label}] K={k}: {rest}")
            else:
                bar.set_postfix_str(f"K={k}: {rest}")

        json_path.unlink(missing_ok=True)  # never report a previous run's numbers
        t0 = time.monotonic()
        rc, timed_out = run_child(
            cmd,
            self.out / "logs" / f"{step.name}.log",
            min(limit + KILL_GRACE_S, left),
            on_line,
            bar.refresh,
        )
        wall = time.monotonic() - t0
        bar.close()
        record.update(rc=rc, timed_out=timed_out, wall_s=wall, log=f"logs/{step.name}.log")
        result: dict[str, Any] | None = None
        if json_path.exists():
            child = json.loads(json_path.read_text(encoding="utf-8"))
            record["json"] = f"raw/{step.name}.json"
            record["echo_path"] = child.get("echo_path")
            expected = self.doc["interpreters"][step.side]["echo_path"]
            if child.get("echo_path") != expected:
                record["warning"] = f"imported echo from {child.get('echo_path')}, not {expected}"
                say(f"benches: warning: {step.name}: {record['warning']}")
            result = child.get("scenarios", {}).get(step.scenario)
            for key in ("loadavg_before", "loadavg_after", "echo_build"):
                if key in child:
                    record[key] = child[key]
        if result is None:
            tail = (self.out / "logs" / f"{step.name}.log").read_text(encoding="utf-8")
            say(f"benches: {step.name} failed (exit {rc}, timed out {timed_out}); log tail:")
            say("\n".join(tail.splitlines()[-15:]))
        else:
            self.doc[step.kind].setdefault(step.side, {})[step.scenario] = result
            if step.kind == "inprocess":
                say(
                    f"  {step.scenario} [{step.label}] in-process: "
                    f"{result['samples_per_s']:,.0f} samples/s, {result['gbps']:.3f} GB/s, "
                    f"sample() p50 {result['sample_overhead'].get('p50_us', math.nan):.1f} us, "
                    f"correct {result['correct']} ({wall:.1f} s)"
                )
            elif step.kind == "views":
                per = ", ".join(
                    f"{n} leaves {r.get('us_per_call', math.nan):.2f}"
                    for n, r in result["by_leaves"].items()
                )
                say(
                    f"  sample() on a complete batch [{step.label}]: {per} us, "
                    f"correct {result['correct']} ({wall:.1f} s)"
                )
        overall.update(1)


def _plan(args: argparse.Namespace, labels: dict[str, str]) -> list[Step]:
    pythons = {"ours": sys.executable, "other": args.compare}
    sides = list(SIDES) if args.compare else ["ours"]
    steps: list[Step] = []
    i = 0
    for kind, names in (
        ("inprocess", SCENARIO_NAMES),
        ("views", (core_views.SCENARIO,)),
        ("tcp", SCENARIO_NAMES + TCP_EXTRA),
    ):
        for name in names:
            order = sides if i % 2 == 0 else sides[::-1]
            if name in OURS_ONLY:
                order = ["ours"]
            steps += [Step(kind, name, s, pythons[s], labels[s]) for s in order]
            i += 1
    return steps


def _run_limits(progress: Progress, quick: bool, after: bool) -> dict[str, Any]:
    todo = limits.loopback_steps(quick) if after else limits.steps(quick)
    desc = "raw limits (loopback again)" if after else "raw limits"
    bar = progress.bar(total=len(todo), desc=desc, unit="step", position=1, leave=False)
    res: dict[str, Any] = {}
    for name, fn in todo:
        bar.set_postfix_str(name)
        res[name] = fn()
        bar.update(1)
    bar.close()
    return res


def _fill_fractions(doc: dict[str, Any]) -> None:
    lo = doc["limits"].get("loopback_64k", {}).get("gbps")
    lo1m = doc["limits"].get("loopback_1m", {}).get("gbps")
    for side in doc["tcp"].values():
        for rounds in side.values():
            for r in rounds.values():
                r["frac_loopback"] = r["gbps"] / lo if lo else None
                r["frac_loopback_1mib"] = r["gbps"] / lo1m if lo1m else None
    mem = doc["limits"].get("memcpy", {}).get("gbps")
    for side in doc["inprocess"].values():
        for r in side.values():
            r["frac_of_raw_memcpy"] = r["gbps"] / mem if mem else None


def _ratios(doc: dict[str, Any]) -> dict[str, Any]:
    """Per kind, one record per metric: ours, other and ours / other (``compare.py``)."""
    out: dict[str, Any] = {}
    for kind, ratio_rows, ids in (
        ("inprocess", compare.inprocess_ratio_rows, ("scenario",)),
        ("tcp", compare.tcp_ratio_rows, ("scenario", "workers")),
    ):
        sides = doc[kind]
        out[kind] = []
        if not (sides.get("ours") and sides.get("other")):
            continue
        for row in ratio_rows(sides["ours"], sides["other"]):
            *names, metric, a, b, ratio, higher = row
            rec: dict[str, Any] = dict(zip(ids, names, strict=True))
            if "workers" in rec:
                rec["workers"] = int(rec["workers"])
            rec.update(metric=metric, ours=a, other=b, ratio=ratio, higher_is_better=higher)
            out[kind].append(rec)
    return out


# --------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benches",
        description="echo's benchmarks: raw machine limits, in-process scenarios and the TCP "
        "actor sweep in one session; JSON, PNG plots and a summary table.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke mode: short in-process runs, TCP K=1,4 with 1.5 s each",
    )
    p.add_argument("--out", type=Path, default=None, help="default benches/results/<timestamp>")
    p.add_argument("--label", default=None, help="name of our side (default echo-<version>)")
    p.add_argument(
        "--compare",
        metavar="PYTHON",
        default=None,
        help="another interpreter with its own echo (e.g. /venvs/peer/bin/python): run every "
        "scenario with it too, interleaved, and report ratios",
    )
    p.add_argument("--compare-label", default=None, help="name of the other side")
    p.add_argument(
        "--workers",
        type=core_tcp.parse_workers,
        default=None,
        help=f"TCP worker counts, comma-separated, each up to {core_tcp_scenarios.MAX_WORKERS} "
        "(default 1,4,16,64; --quick 1,4)",
    )
    p.add_argument(
        "--seconds", type=float, default=None, help="TCP window per K (default 4; --quick 1.5)"
    )
    p.add_argument(
        "--launcher",
        choices=core_tcp_scenarios.LAUNCHERS,
        default="process",
        help="TCP workers as local processes (default) or as Ray actors in a local Ray "
        "instance, the learner's server in the driver (needs the distributed extra: "
        "pip install 'id-echo[distributed]')",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="no step starts after this long (default 3600; --quick 300)",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bars on stderr (default: when stderr is a terminal)",
    )
    return p


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_child, which ends the running child


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    t_start = time.monotonic()
    quick: bool = args.quick
    ks: list[int] = args.workers or list(QUICK_WORKERS if quick else DEFAULT_WORKERS)
    seconds: float = args.seconds or (1.5 if quick else 4.0)
    if not 0.1 <= seconds <= 600:
        print("benches: --seconds must be in [0.1, 600]", file=sys.stderr)
        return 2
    max_seconds: float = args.max_seconds or (300.0 if quick else 3600.0)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    out: Path = args.out or ROOT / "benches" / "results" / time.strftime("%Y%m%d-%H%M%S")
    progress = Progress(sys.stderr.isatty() if args.progress is None else args.progress)
    if args.progress and tqdm_missing():
        print("benches: tqdm is not installed: no progress bars", file=sys.stderr)

    compare_py: str | None = args.compare
    if compare_py:  # the children run in the repository root: an absolute path
        found = shutil.which(compare_py) if os.sep not in compare_py else compare_py
        args.compare = compare_py = os.path.abspath(found or compare_py)
    try:
        interpreters = {"ours": probe(sys.executable)}
        if compare_py:
            interpreters["other"] = probe(compare_py)
    except RuntimeError as e:
        print(f"benches: {e}", file=sys.stderr)
        return 2
    ours = interpreters["ours"]
    if args.launcher == "ray":
        for info in interpreters.values():
            if not info.get("ray"):
                msg = core_tcp_workers.RAY_MISSING.format(python=info["executable"])
                print(f"benches: {msg}", file=sys.stderr)
                return 2
    labels = {"ours": args.label or f"echo-{ours['echo_version']}"}
    if "other" in interpreters:
        other = interpreters["other"]
        if os.path.realpath(other["echo_path"]) == os.path.realpath(ours["echo_path"]):
            print(
                f"benches: --compare {compare_py} imports the same echo "
                f"({ours['echo_path']}): nothing to compare",
                file=sys.stderr,
            )
            return 2
        label = args.compare_label or f"echo-{other['echo_version']}"
        labels["other"] = label if label != labels["ours"] else f"{label} (other)"
    for side, info in interpreters.items():
        info["label"] = labels[side]

    for sub in ("raw", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    commit = h.git_commit()
    dirty = bool((h.git("status", "--porcelain", "--untracked-files=no") or "").strip())
    steps = _plan(args, labels)
    doc: dict[str, Any] = {
        "schema": "echo-benches/1",
        "label": labels["ours"],
        "compare_label": labels.get("other"),
        "started": started,
        "commit": commit,
        "commit_dirty": dirty,
        "machine": machine_info(),
        "interpreters": interpreters,
        "driver": {"executable": sys.executable, "argv": sys.argv[1:] if argv is None else argv},
        "parameters": {
            "quick": quick,
            "workers": ks,
            "tcp_seconds": seconds,
            "tcp_warmup_s": TCP_WARMUP_S,
            "tcp_launcher": args.launcher,
            "inprocess": "core_inprocess.py defaults" + (" with --quick" if quick else ""),
            "views": "core_views.py defaults" + (" with --quick" if quick else ""),
            "order": [s.name for s in steps],
            "max_seconds": max_seconds,
        },
        "limits": {},
        "inprocess": {},
        "views": {},
        "tcp": {},
        "steps": [],
    }
    session = Session(args, out, ks, seconds, progress, t_start + max_seconds, doc)
    progress.say(
        f"benches: {' vs '.join(labels.values())}; {len(steps)} scenario runs, TCP K="
        f"{','.join(map(str, ks))} x {seconds:g} s; output in {out}"
    )

    overall = progress.bar(
        total=len(steps) + 1 + (0 if quick else 1),
        desc="benches",
        unit="step",
        position=0,
        leave=True,
    )
    overall.set_postfix_str("raw limits")
    doc["limits"] = _run_limits(progress, quick, after=False)
    overall.update(1)
    lim = doc["limits"]
    progress.say(
        f"  raw limits: memcpy {lim['memcpy']['gbps']:.2f} GB/s, loopback "
        f"{lim['loopback_64k']['gbps']:.2f} GB/s (64 KiB) / {lim['loopback_1m']['gbps']:.2f} GB/s"
        f" (1 MiB), flatten {lim['flatten_small']['us_per_call']:.2f} / "
        f"{lim['flatten_large']['us_per_call']:.2f} us"
    )
    for step in steps:
        session.run_step(step, overall)
    again: dict[str, Any] = {}
    if not quick:
        overall.set_postfix_str("loopback again")
        again = _run_limits(progress, quick, after=True)
        overall.update(1)
    for key in ("loopback_64k", "loopback_1m"):
        lim[key] = core_tcp_workers.best_loopback(lim[key], again.get(key))
    overall.close()

    _fill_fractions(doc)
    doc["ratios"] = _ratios(doc)
    doc["machine"]["loadavg_after"] = os.getloadavg()
    doc["wall_s"] = time.monotonic() - t_start
    ok_steps = [s for s in doc["steps"] if s["step"].endswith("-ours")]
    ours_ok = all(s.get("rc") == 0 for s in ok_steps) and all(
        r.get("correct") for r in doc["inprocess"].get("ours", {}).values()
    )
    ours_ok = ours_ok and all(
        r.get("correct") for rounds in doc["tcp"].get("ours", {}).values() for r in rounds.values()
    )
    ours_ok = ours_ok and all(r.get("correct") for r in doc["views"].get("ours", {}).values())
    doc["ours_correct"] = ours_ok
    results = out / "results.json"
    h.write_json(results, doc, say=False)
    try:
        pngs = plots.plot_all(doc, out)
    except Exception as e:  # noqa: BLE001  a plot must never lose the numbers
        print(f"benches: plotting failed: {type(e).__name__}: {e}", file=sys.stderr)
        pngs = []
    doc["plots"] = [p.name for p in pngs]
    h.write_json(results, doc, say=False)
    text = summary(doc)
    (out / "summary.txt").write_text(text + "\n", encoding="utf-8")
    print(text)
    print(f"wrote {results}" + "".join(f", {p}" for p in pngs) + f" in {doc['wall_s']:.0f} s")
    if not ours_ok:
        print("benches: some scenario of ours failed or was not correct", file=sys.stderr)
    return 0 if ours_ok else 1
