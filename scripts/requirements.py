#!/usr/bin/env python3
"""Print the requirement lines of pyproject.toml extras, one a line, for `pip install`.

    python3 scripts/requirements.py dev            # the `dev` extra
    python3 scripts/requirements.py --deps dev     # [project].dependencies, then the `dev` extra
    python3 scripts/requirements.py docs bench     # several extras, in order, duplicates once

Tool versions are declared once, in [project.optional-dependencies]; the scripts install from
here (scripts/venv.sh). An extra that names this project (`id-echo[bench]`) is expanded in
place. [build-system].requires must appear verbatim in the `dev` extra (maturin is both the
PEP 517 backend and the tool scripts/_env.sh runs), and this fails if the two drift apart.

Runs on Python 3.10+: tomllib, else tomli, else a small reader for the few tables used here.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def _code(text: str) -> Iterator[tuple[int, str]]:
    """(index, character) for each character of `text` that stands outside a string."""
    quote = ""
    escaped = False
    for i, c in enumerate(text):
        if escaped:
            escaped = False
        elif quote:
            if c == "\\" and quote == '"':
                escaped = True
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        else:
            yield i, c


def _strip_comment(line: str) -> str:
    """The line without a `#` comment (one that stands outside a string)."""
    return next((line[:i] for i, c in _code(line) if c == "#"), line)


def _depth(text: str) -> int:
    """Open brackets minus closed ones in comment-free text, outside strings."""
    return sum(1 if c in "[{" else -1 for _, c in _code(text) if c in "[]{}")


def _mini_toml(text: str) -> dict[str, Any]:
    """Reads the subset of TOML that the tables used here are written in: `[table]` headers and
    `key = value` where value is a one-line string or an array of strings (over several lines
    allowed). Anything else in those tables raises, rather than being read wrongly; other
    tables' values are skipped. For Python 3.10 without tomli."""
    wanted = {"project", "project.optional-dependencies", "build-system"}
    doc: dict[str, Any] = {}
    table: dict[str, Any] | None = None
    name = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = _strip_comment(lines[i]).strip()
        i += 1
        if not line:
            continue
        header = re.fullmatch(r"\[\s*([A-Za-z0-9_.\"-]+)\s*\]", line)
        if header:
            name = header.group(1).replace('"', "")
            table = doc
            for part in name.split("."):
                table = table.setdefault(part, {})
            continue
        if line.startswith("[["):
            name, table = line, None
            continue
        kv = re.fullmatch(r'("[^"]*"|[A-Za-z0-9_-]+)\s*=\s*(.*)', line)
        if not kv:
            if name in wanted:
                raise ValueError(f"cannot read {line!r} in [{name}]: pip install tomli")
            continue
        key, value = kv.group(1).strip('"'), kv.group(2)
        while _depth(value) > 0 and i < len(lines):  # an array over several lines
            value += " " + _strip_comment(lines[i]).strip()
            i += 1
        if name not in wanted or table is None:
            continue
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parsed = None
        ok = isinstance(parsed, str) or (
            isinstance(parsed, list) and all(isinstance(x, str) for x in parsed)
        )
        if not ok:
            if name == "project" and key not in {"dependencies", "name", "optional-dependencies"}:
                continue  # fields this script does not read (license, dynamic, ...)
            raise ValueError(f"cannot read {key} = {value} in [{name}]: pip install tomli")
        table[key] = parsed
    return doc


def load(path: Path = PYPROJECT, mini: bool = False) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    if not mini:
        try:
            import tomllib  # Python 3.11+
        except ModuleNotFoundError:
            try:
                import tomli as tomllib  # type: ignore[no-redef]
            except ModuleNotFoundError:
                mini = True
    if mini:
        return _mini_toml(text)
    return tomllib.loads(text)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve(doc: dict[str, Any], extras: list[str], deps: bool) -> list[str]:
    project = doc.get("project", {})
    me = _canonical(project.get("name", ""))
    table: dict[str, list[str]] = project.get("optional-dependencies", {})
    out: list[str] = []

    def add(req: str) -> None:
        if req not in out:
            out.append(req)

    def expand(extra: str, seen: tuple[str, ...]) -> None:
        if extra not in table:
            known = ", ".join(sorted(table))
            sys.exit(f"requirements.py: no extra {extra!r} in pyproject.toml (it has: {known})")
        if extra in seen:
            sys.exit(f"requirements.py: extras include each other: {' -> '.join((*seen, extra))}")
        for req in table[extra]:
            self_ref = re.fullmatch(r"\s*([A-Za-z0-9._-]+)\s*\[([^\]]*)\]\s*", req)
            if self_ref and _canonical(self_ref.group(1)) == me:
                for sub in self_ref.group(2).split(","):
                    expand(sub.strip(), (*seen, extra))
            else:
                add(req)

    if deps:
        for req in project.get("dependencies", []):
            add(req)
    for extra in extras:
        expand(extra, ())
    return out


def check_build_system(doc: dict[str, Any]) -> None:
    dev = resolve(doc, ["dev"], deps=False)
    missing = [r for r in doc.get("build-system", {}).get("requires", []) if r not in dev]
    if missing:
        sys.exit(
            f"requirements.py: [build-system].requires {missing} is not in the dev extra "
            "word for word; declare the same version in both"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("extras", nargs="+", help="names in [project.optional-dependencies]")
    parser.add_argument("--deps", action="store_true", help="[project].dependencies first")
    parser.add_argument("--mini-toml", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    doc = load(mini=args.mini_toml)
    check_build_system(doc)
    print("\n".join(resolve(doc, args.extras, args.deps)))


if __name__ == "__main__":
    main()
