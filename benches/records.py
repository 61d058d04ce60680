"""Benchmark records: what one suite run measured, as JSON, and the tables of
``docs/benchmarks.md`` rendered from them.

A record is ``{"schema", "suite", "description", "command", "started", "quick",
"parameters", "machine", "interpreters", "commit", "commit_dirty", "results", "tables",
"ok", "wall_s"}``: ``machine`` names the CPU model, cores, kernel and platform;
``interpreters`` the Python, numpy and echo versions of each side; ``results`` the suite's
own numbers per side; ``tables`` what the docs show (see ``benches/suites/__init__.py``).
Every run writes its record as ``OUT/SUITE.json``; ``--save`` also writes it to
``benches/records/SUITE.json``, the committed records the docs are rendered from.

``python -m benches report`` replaces each block of ``docs/benchmarks.md`` between
``<!-- benches:table SUITE -->`` and ``<!-- /benches:table -->`` with the tables of
``benches/records/SUITE.json``, and each block between ``<!-- benches:plot SUITE NAME -->``
and ``<!-- /benches:plot -->`` with the image ``img/SUITE-NAME.png`` (alt text and caption
naming the record, machine and commit) after drawing that PNG from the record
(``benches/plots.py``; without matplotlib the PNGs already there are kept). ``--check``
changes nothing and fails (exit 1) when a block differs from what its record renders, names
a suite without a record or a plot ``benches/plots.py`` does not draw, or when an image the
page shows is missing or is not in a plot block. It compares no PNG bytes: they differ
across matplotlib versions. Standard library only (matplotlib is imported only to draw):
the docs build runs it with the docs virtualenv.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any

from benches import common

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benches" / "records"
PAGE = ROOT / "docs" / "benchmarks.md"
SCHEMA = "echo-benches-record/1"
RENDERED = (":(exclude)benches/records", ":(exclude)docs/benchmarks.md")
BLOCK = re.compile(
    r"(<!-- benches:table (?P<suite>[\w-]+) -->\n)(?P<body>.*?)(<!-- /benches:table -->)",
    re.DOTALL,
)
PLOT = re.compile(
    r"(<!-- benches:plot (?P<suite>[\w-]+) (?P<name>[\w-]+) -->\n)(?P<body>.*?)"
    r"(<!-- /benches:plot -->)",
    re.DOTALL,
)
IMAGE = re.compile(r"!\[[^\]]*\]\((?P<src>[^)\s]+)\)")


def machine() -> dict[str, Any]:
    """The machine a record was measured on."""
    return {
        "cpu": common.cpu_model() or platform.machine(),
        "cores": os.cpu_count(),
        "kernel": f"{platform.system()} {platform.release()}",
        "platform": platform.platform(),
        "loadavg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def checkout() -> dict[str, Any]:
    """The commit of this checkout and whether tracked files differ from it, records and the
    page rendered from them aside (a run that saves records changes those, not what it
    measures)."""
    commit = (common.git("rev-parse", "HEAD") or "").strip() or None
    status = common.git("status", "--porcelain", "--untracked-files=no", "--", ".", *RENDERED) or ""
    return {"commit": commit, "commit_dirty": bool(status.strip())}


def write(path: Path, record: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    return path


# --------------------------------------------------------------------------- rendering


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def render_table(table: dict[str, Any]) -> str:
    lines = [f"**{table['title']}**", ""]
    lines.append("| " + " | ".join(_cell(c) for c in table["columns"]) + " |")
    lines.append("|" + "|".join("---" for _ in table["columns"]) + "|")
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in table["rows"]]
    for note in table.get("notes", []):
        lines += ["", note]
    return "\n".join(lines)


def provenance(record: dict[str, Any], source: str) -> str:
    m = record["machine"]
    sides = record["interpreters"]
    ours = sides.get("ours", {})
    commit = (record.get("commit") or "unknown")[:10]
    dirty = " with uncommitted changes" if record.get("commit_dirty") else ""
    other = ""
    if "other" in sides:
        o = sides["other"]
        other = f", against echo {o.get('echo_version')} (Python {o.get('python_version')})"
    return (
        f"*Measured by `{record['command']}` on {m['cpu']} ({m['cores']} cores, "
        f"{m['kernel']}), Python {ours.get('python_version')}, echo "
        f"{ours.get('echo_version')}{other}, commit `{commit}`{dirty}, "
        f"{record['started'][:10]}"
        f"{' (quick parameters)' if record.get('quick') else ''}. Record: `{source}`.*"
    )


def render(record: dict[str, Any], source: str) -> str:
    parts = [provenance(record, source)]
    parts += [render_table(t) for t in record["tables"]]
    return "\n\n".join(parts) + "\n"


def load(suite: str, records: Path = RECORDS) -> dict[str, Any] | None:
    path = records / f"{suite}.json"
    if not path.exists():
        return None
    doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return doc


def render_plot(record: dict[str, Any], suite: str, name: str, what: str) -> str:
    m = record["machine"]
    commit = (record.get("commit") or "unknown")[:10]
    alt = (
        f"{what}, from benches/records/{suite}.json: {m['cpu']}, {m['cores']} cores, "
        f"commit {commit}, {record['started'][:10]}"
    )
    caption = provenance(record, f"benches/records/{suite}.json")
    return f"![{alt}](img/{suite}-{name}.png)\n\n{caption}\n"


def _draw(todo: list[tuple[dict[str, Any], str, Path]]) -> tuple[int, list[str]]:
    """Draws the PNGs of ``todo``; the count drawn, and the problems."""
    from benches import plots

    drawn = 0
    problems: list[str] = []
    for record, name, path in todo:
        try:
            out = plots.plot_record(record, name, path)
        except ImportError:
            kept = sum(1 for _, _, p in todo if p.exists())
            print(
                f"benches report: matplotlib is not installed: kept the {kept} PNGs there "
                f"(of {len(todo)}); install the bench extra to redraw them",
                file=sys.stderr,
            )
            return drawn, []
        if out is None:
            problems.append(f"{path.name}: {record['suite']} record has no data for {name}")
        else:
            drawn += 1
    return drawn, problems


def report(check: bool, page: Path = PAGE, records: Path = RECORDS) -> int:
    """Renders every table and plot block of ``page`` from its record (``check``: only
    compares, and checks that every image the page shows exists and is drawn from a record)."""
    from benches.plots import PLOTS

    text = page.read_text(encoding="utf-8")
    problems: list[str] = []
    seen: list[str] = []
    todo: list[tuple[dict[str, Any], str, Path]] = []

    def replace(m: re.Match[str]) -> str:
        suite = m.group("suite")
        seen.append(suite)
        record = load(suite, records)
        if record is None:
            problems.append(f"{suite}: no record {records / (suite + '.json')}")
            return m.group(0)
        body = render(record, f"benches/records/{suite}.json")
        if body != m.group("body"):
            problems.append(f"{suite}: the table differs from its record")
        return m.group(1) + body + m.group(4)

    def replace_plot(m: re.Match[str]) -> str:
        suite, name = m.group("suite"), m.group("name")
        record = load(suite, records)
        if record is None:
            problems.append(f"plot {suite} {name}: no record {records / (suite + '.json')}")
            return m.group(0)
        if (suite, name) not in PLOTS:
            problems.append(f"plot {suite} {name}: benches/plots.py draws no such plot")
            return m.group(0)
        body = render_plot(record, suite, name, PLOTS[suite, name])
        if body != m.group("body"):
            problems.append(f"plot {suite} {name}: the block differs from its record")
        todo.append((record, name, page.parent / "img" / f"{suite}-{name}.png"))
        return m.group(1) + body + m.group(5)

    new = PLOT.sub(replace_plot, BLOCK.sub(replace, text))
    outside = IMAGE.findall(PLOT.sub("", new))
    problems += [
        f"{src}: an image not drawn from a record (no benches:plot block)" for src in outside
    ]
    rel = os.path.relpath(page, ROOT)
    if check:
        problems += [f"{os.path.relpath(p, ROOT)}: missing" for _, _, p in todo if not p.exists()]
        for p in problems:
            print(f"benches report --check: {rel}: {p}", file=sys.stderr)
        if problems:
            print("  run `python -m benches report` to regenerate the page", file=sys.stderr)
            return 1
        print(
            f"benches report --check: {rel}: {len(seen)} tables match their records; "
            f"{len(todo)} plots drawn from records, all there (PNG bytes not compared)"
        )
        return 0
    failed = [p for p in problems if "differs" not in p]
    drawn, draw_problems = _draw(todo)
    failed += draw_problems
    failed += [f"{os.path.relpath(p, ROOT)}: missing" for _, _, p in todo if not p.exists()]
    for p in failed:
        print(f"benches report: {rel}: {p}", file=sys.stderr)
    if new != text:
        page.write_text(new, encoding="utf-8")
        print(
            f"benches report: {rel}: rewrote {len(seen)} tables and {len(todo)} plot blocks "
            "from benches/records/"
        )
    else:
        print(f"benches report: {rel}: {len(seen)} tables, {len(todo)} plots, already up to date")
    if drawn:
        print(f"benches report: drew {drawn} of {len(todo)} plots into docs/img/ from records")
    return 1 if failed else 0
