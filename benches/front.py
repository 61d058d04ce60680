"""``python -m benches``: the one front door to echo's benchmarks.

Usage::

    python -m benches --list                     # the suites, one line each
    python -m benches [SUITE ...] [--quick] [--compare PYTHON] [--out DIR] [--save]
                      [--set KEY=VALUE ...] [--max-seconds S] [core's options]
    python -m benches report [--check]           # docs/benchmarks.md (tables, plots) from records

Without a suite it runs ``core`` (raw limits, in-process, views, the TCP sweep: see
``benches/suites/core.py``, whose options ``--workers``, ``--seconds``, ``--launcher`` and
``--progress`` it also takes). Every suite writes its record, ``OUT/SUITE.json`` (see
``benches/records.py``), into ``OUT`` (default ``benches/results/<timestamp>``, not
committed); ``--save`` also writes it to ``benches/records/SUITE.json``, the committed
records ``docs/benchmarks.md`` is rendered from. ``--compare PYTHON`` measures every suite
with that interpreter's echo too, one side right after the other. ``--set KEY=VALUE``
changes one of a suite's parameters (the record lists them; the value is read as JSON when
it parses, else as a string). Exit status 0 when every suite of ours ran and was correct, 1
otherwise, 2 for a bad invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benches import records
from benches.suites import BY_NAME, SUITES, Suite

ROOT = records.ROOT
SIDES = ("ours", "other")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benches",
        description="echo's benchmarks: named suites, each writing a JSON record; "
        "`python -m benches report` renders docs/benchmarks.md (tables and plots) from the "
        "committed records.",
        epilog="Suites: " + ", ".join(s.name for s in SUITES),
    )
    p.add_argument("suites", nargs="*", metavar="SUITE", help="suites to run (default: core)")
    p.add_argument("--list", action="store_true", help="list the suites and exit")
    p.add_argument("--quick", action="store_true", help="small parameters (smoke runs, CI)")
    p.add_argument("--out", type=Path, default=None, help="default benches/results/<timestamp>")
    p.add_argument("--save", action="store_true", help="also write benches/records/SUITE.json")
    p.add_argument("--compare", metavar="PYTHON", default=None, help="another echo's python")
    p.add_argument("--label", default=None, help="name of our side")
    p.add_argument("--compare-label", default=None, help="name of the other side")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change a suite parameter (for every suite run that has it)",
    )
    p.add_argument(
        "--max-seconds", type=float, default=None, help="no suite starts after this long"
    )
    core = p.add_argument_group("the core suite's options (see benches/suites/core.py)")
    core.add_argument("--workers", default=None, help="TCP worker counts, e.g. 1,4,16,64")
    core.add_argument("--seconds", default=None, help="TCP window per K")
    core.add_argument("--launcher", default=None, help="process (default) or ray")
    core.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bars"
    )
    return p


def _core_options(args: argparse.Namespace) -> list[str]:
    """The core suite's own options as given, for benches/suites/core.py to parse and check."""
    out = [
        f"--{name}={getattr(args, name)}"
        for name in ("workers", "seconds", "launcher")
        if getattr(args, name) is not None
    ]
    if args.progress is not None:
        out.append("--progress" if args.progress else "--no-progress")
    return out


def _overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def list_suites() -> str:
    width = max(len(s.name) for s in SUITES)
    return "\n".join(f"{s.name:<{width}}  {s.description}" for s in SUITES)


def _command(suite: Suite, args: argparse.Namespace, rest: list[str]) -> str:
    """The command that reruns one suite as it ran (without where its output went)."""
    words = ["python -m benches", suite.name, *(["--quick"] if args.quick else [])]
    words += [f"--set {item}" for item in args.overrides if suite.name != "core"]
    words += [w for w in rest if "progress" not in w] if suite.name == "core" else []
    if args.compare:
        words.append("--compare OTHER_PYTHON")
    return " ".join(words)


def _record_head(
    suite: Suite, args: argparse.Namespace, rest: list[str], checkout: dict[str, Any]
) -> dict[str, Any]:
    return {
        "schema": records.SCHEMA,
        "suite": suite.name,
        "description": suite.description,
        "command": _command(suite, args, rest),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": bool(args.quick),
        "machine": records.machine(),
        **checkout,
    }


def _finish(record: dict[str, Any], out: Path, save: bool, t0: float, say: Any = print) -> bool:
    record["wall_s"] = round(time.monotonic() - t0, 1)
    path = records.write(out / f"{record['suite']}.json", record)
    say(f"benches: {record['suite']}: record {path}")
    if save:
        saved = records.write(records.RECORDS / f"{record['suite']}.json", record)
        say(f"benches: {record['suite']}: saved {saved.relative_to(ROOT)}")
    for table in record["tables"]:
        say(records.render_table(table))
        say("")
    return bool(record["ok"])


TCP_KEYS = (
    "samples_per_s",
    "gbps",
    "sample_bytes",
    "frac_loopback",
    "p50_ms",
    "p99_ms",
    "correct",
)
INPROCESS_KEYS = (
    "samples_per_s",
    "gbps",
    "frac_of_memcpy",
    "memcpy_gbps",
    "correct",
    "in_order",
    "sample_overhead",
)


def _core_results(doc: dict[str, Any]) -> dict[str, Any]:
    """The numbers of a core session worth keeping in its record (a few KB); every detail
    (per-worker counts, CPU use, timings of each phase) stays in the session's results.json."""
    tcp = {
        side: {
            name: {k: {key: r.get(key) for key in TCP_KEYS} for k, r in rounds.items()}
            for name, rounds in scenarios.items()
        }
        for side, scenarios in doc["tcp"].items()
    }
    inprocess = {
        side: {name: {k: r.get(k) for k in INPROCESS_KEYS} for name, r in scenarios.items()}
        for side, scenarios in doc["inprocess"].items()
    }
    limits = {
        name: {k: v for k, v in r.items() if k in ("gbps", "us_per_call", "leaves", "chunk_bytes")}
        for name, r in doc["limits"].items()
    }
    views = {
        side: {
            name: {
                "by_leaves": {n: x.get("us_per_call") for n, x in v["by_leaves"].items()},
                "correct": v["correct"],
            }
            for name, v in scenarios.items()
        }
        for side, scenarios in doc["views"].items()
    }
    return {
        "limits": limits,
        "inprocess": inprocess,
        "views": views,
        "tcp": tcp,
        "ratios": doc["ratios"],
    }


def run_core(
    args: argparse.Namespace, rest: list[str], out: Path, checkout: dict[str, Any]
) -> bool:
    from benches.suites import core

    t0 = time.monotonic()
    core_argv = [*rest, "--out", str(out)]
    if args.quick:
        core_argv.append("--quick")
    for flag, value in (
        ("--compare", args.compare),
        ("--label", args.label),
        ("--compare-label", args.compare_label),
        ("--max-seconds", args.max_seconds),
    ):
        if value is not None:
            core_argv += [flag, str(value)]
    status = core.main(core_argv)
    results = out / "results.json"
    if not results.exists():
        return False
    doc = json.loads(results.read_text(encoding="utf-8"))
    record = _record_head(BY_NAME["core"], args, rest, checkout)
    record.update(
        parameters=doc["parameters"],
        interpreters=doc["interpreters"],
        results=_core_results(doc),
        tables=core.tables(doc),
        ok=status == 0,
    )
    return _finish(record, out, args.save, t0)


def run_suite(
    suite: Suite,
    args: argparse.Namespace,
    sides: dict[str, str],
    out: Path,
    deadline: float,
    checkout: dict[str, Any],
    first: int,
) -> bool:
    from benches import runner

    module = suite.load()
    t0 = time.monotonic()
    params: dict[str, Any] = module.parameters(args.quick)
    for key, value in _overrides(args.overrides).items():
        if key in params:
            params[key] = value
    logs = out / suite.name
    logs.mkdir(parents=True, exist_ok=True)
    record = _record_head(suite, args, [], checkout)
    record.update(parameters=params, interpreters={}, results={})
    order = list(sides) if first % 2 == 0 else list(sides)[::-1]
    for side in order:
        left = deadline - time.monotonic()
        if left < 5.0:
            record["results"][side] = {"error": "skipped: over --max-seconds"}
            continue
        json_path = logs / f"{side}.json"
        json_path.unlink(missing_ok=True)
        cmd = [
            sides[side],
            "-m",
            "benches._child",
            suite.module,
            json.dumps(params),
            str(json_path),
        ]
        print(f"benches: {suite.name} [{side}]: {sides[side]}", file=sys.stderr, flush=True)
        rc, timed_out = runner.run_child(
            cmd,
            logs / f"{side}.log",
            min(module.limit_s(params) + runner.KILL_GRACE_S, left),
            lambda stream, line: print(f"  {line}", file=sys.stderr, flush=True),
            lambda: None,
        )
        child: dict[str, Any] = {}
        if json_path.exists():
            child = json.loads(json_path.read_text(encoding="utf-8"))
        record["interpreters"][side] = child.get("interpreter", {"executable": sides[side]})
        if "result" in child:
            record["results"][side] = child["result"]
        else:
            why = child.get("error") or f"exit status {rc}" + (", timed out" if timed_out else "")
            record["results"][side] = {"error": why}
            print(f"benches: {suite.name} [{side}] failed: {why}", file=sys.stderr)
    ours = record["results"].get("ours", {})
    record["tables"] = module.tables(record["results"], params)
    record["ok"] = "error" not in ours and bool(ours.get("correct", True))
    return _finish(record, out, args.save, t0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        p = argparse.ArgumentParser(prog="python -m benches report")
        p.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
        return records.report(p.parse_args(argv[1:]).check)
    args = _parser().parse_args(argv)
    rest = _core_options(args)
    if args.list:
        print(list_suites())
        return 0
    unknown = [s for s in args.suites if s not in BY_NAME]
    if unknown:
        print(f"benches: no suite {', '.join(unknown)}; `--list` shows them", file=sys.stderr)
        return 2
    names = list(dict.fromkeys(args.suites or ["core"]))
    if rest and "core" not in names:
        print(f"benches: {' '.join(rest)}: only the core suite takes these", file=sys.stderr)
        return 2
    try:
        _overrides(args.overrides)
    except ValueError as e:
        print(f"benches: {e}", file=sys.stderr)
        return 2
    out: Path = args.out or ROOT / "benches" / "results" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    sides = {"ours": sys.executable}
    if args.compare:
        found = shutil.which(args.compare) if os.sep not in args.compare else args.compare
        sides["other"] = os.path.abspath(found or args.compare)
    max_seconds = args.max_seconds or (300.0 if args.quick else 3600.0)
    deadline = time.monotonic() + max_seconds
    checkout = records.checkout()  # before any record is saved into the checkout
    ok = True
    for i, name in enumerate(names):
        if name == "core":
            ok = run_core(args, rest, out, checkout) and ok
        elif time.monotonic() > deadline - 5.0:
            print(f"benches: {name}: skipped, over --max-seconds", file=sys.stderr)
            ok = False
        else:
            ok = run_suite(BY_NAME[name], args, sides, out, deadline, checkout, i) and ok
    return 0 if ok else 1
