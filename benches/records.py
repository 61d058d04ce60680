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
``benches/records/SUITE.json``; ``--check`` changes nothing and fails (exit 1) when a block
differs from what its record renders, or names a suite without a record. Standard library
only: the docs build runs it with the docs virtualenv.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benches" / "records"
PAGE = ROOT / "docs" / "benchmarks.md"
SCHEMA = "echo-benches-record/1"
RENDERED = (":(exclude)benches/records", ":(exclude)docs/benchmarks.md")
BLOCK = re.compile(
    r"(<!-- benches:table (?P<suite>[\w-]+) -->\n)(?P<body>.*?)(<!-- /benches:table -->)",
    re.DOTALL,
)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """The machine a record was measured on."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "kernel": f"{platform.system()} {platform.release()}",
        "platform": platform.platform(),
        "loadavg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def checkout() -> dict[str, Any]:
    """The commit of this checkout and whether tracked files differ from it, records and the
    page rendered from them aside (a run that saves records changes those, not what it
    measures)."""
    commit = (_git("rev-parse", "HEAD") or "").strip() or None
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", *RENDERED) or ""
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


def report(check: bool, page: Path = PAGE, records: Path = RECORDS) -> int:
    """Renders every table block of ``page`` from its record (``check``: only compares)."""
    text = page.read_text(encoding="utf-8")
    problems: list[str] = []
    seen: list[str] = []

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

    new = BLOCK.sub(replace, text)
    rel = os.path.relpath(page, ROOT)
    if check:
        for p in problems:
            print(f"benches report --check: {rel}: {p}", file=sys.stderr)
        if problems:
            print("  run `python -m benches report` to regenerate the page", file=sys.stderr)
            return 1
        print(f"benches report --check: {rel}: {len(seen)} tables match their records")
        return 0
    missing = [p for p in problems if "no record" in p]
    for p in missing:
        print(f"benches report: {rel}: {p}", file=sys.stderr)
    if new != text:
        page.write_text(new, encoding="utf-8")
        print(f"benches report: {rel}: rewrote {len(seen)} tables from benches/records/")
    else:
        print(f"benches report: {rel}: {len(seen)} tables, already up to date")
    return 1 if missing else 0
