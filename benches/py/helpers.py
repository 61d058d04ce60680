"""What every benchmark script shares: watchdogs and timers, logging, the facts a result
records about the machine and the checkout, argument parsing, JSON output, table cells and
child scripts that answer in JSON.

Standard library only, so that any interpreter runs it: ours, the other echo's virtualenv of
``python -m benches --compare``, the Reverb/TorchRL virtualenv of ``bench_replay_peers.py``.
The scripts in ``benches/py`` import it as ``helpers`` when run on their own (their folder is
then on ``sys.path``) and as ``benches.py.helpers`` when ``python -m benches`` imports them;
the tools in ``benches/tools`` put ``benches/py`` on ``sys.path`` first.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "bench_parser",
    "bounded_int",
    "call_later",
    "cpu_model",
    "default_label",
    "echo_build",
    "fmt_num",
    "fmt_ratio",
    "git",
    "git_commit",
    "int_list",
    "loadavg",
    "logger",
    "print_columns",
    "proc_kib",
    "rate",
    "run_facts",
    "run_json_child",
    "run_title",
    "start_watchdog",
    "timed_loop",
    "write_json",
]

HERE = Path(__file__).resolve().parent

# --------------------------------------------------------------------------- timers, logging


def call_later(seconds: float, fn: Callable[[], object]) -> threading.Timer:
    """Calls ``fn`` from a daemon thread after ``seconds`` unless the timer is cancelled
    first: a guard that closes a server so a ``sample()`` that would never return wakes."""
    timer = threading.Timer(max(0.0, seconds), fn)
    timer.daemon = True
    timer.start()
    return timer


def start_watchdog(max_seconds: float, who: str, status: int = 2) -> threading.Timer:
    """Ends the whole process with ``status`` after ``max_seconds``, saying so on stderr:
    the last resort that keeps every benchmark bounded in time."""

    def fire() -> None:
        print(f"{who}: watchdog: over {max_seconds:.0f} s, aborting", file=sys.stderr)
        sys.stderr.flush()
        os._exit(status)

    return call_later(max_seconds, fire)


def logger(prefix: str) -> Callable[[str], None]:
    """A function that prints ``prefix: msg`` on stderr at once (progress, not results)."""

    def log(msg: str) -> None:
        print(f"{prefix}: {msg}", file=sys.stderr, flush=True)

    return log


# --------------------------------------------------------------------------- machine, checkout


def git(*args: str) -> str | None:
    """``git ARGS`` in this checkout: its output, or None outside a checkout or on failure."""
    try:
        out = subprocess.run(
            ["git", *args], cwd=HERE, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_commit() -> str | None:
    """The checkout's HEAD commit, or None outside a git checkout."""
    return (git("rev-parse", "HEAD") or "").strip() or None


def proc_kib(path: str, *keys: str) -> dict[str, int]:
    """The ``Key: N kB`` lines of a ``/proc`` file (``/proc/meminfo``, ``/proc/PID/status``)
    for ``keys``, in KiB; the keys it could not read are missing."""
    out: dict[str, int] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in keys:
                    out[key] = int(value.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return out


def cpu_model() -> str | None:
    """The CPU's model name (from /proc/cpuinfo on Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def loadavg() -> list[float] | None:
    """The 1/5/15-minute load average (another busy process skews every number)."""
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def echo_build(echo: ModuleType) -> list[dict[str, Any]]:
    """Size, mtime and sha256 prefix of the compiled modules of the imported ``echo`` package:
    which build ran."""
    out: list[dict[str, Any]] = []
    pkg = Path(os.path.realpath(echo.__file__ or "")).parent
    for so in sorted(pkg.glob("*.so")):
        try:
            data = so.read_bytes()
            st = so.stat()
        except OSError:
            continue
        out.append(
            {
                "file": so.name,
                "bytes": st.st_size,
                "mtime": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(st.st_mtime)),
                "sha256": hashlib.sha256(data).hexdigest()[:16],
            }
        )
    return out


def default_label(label: str | None, echo: ModuleType | None) -> str:
    """``--label``, else ``echo-<version>`` of the imported echo."""
    return label or f"echo-{getattr(echo, '__version__', None)}"


def run_title(label: str, echo: ModuleType) -> str:
    """The first line of a script's table: which run, which echo from where."""
    return f"# {label}: echo {getattr(echo, '__version__', None)} from {echo.__file__}"


def run_facts(label: str, echo: ModuleType | None = None) -> dict[str, Any]:
    """The head of every result file: the run's label, the interpreter, numpy (where this
    process imported it) and (given) echo, the machine and the checkout's commit."""
    facts: dict[str, Any] = {
        "label": label,
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
    }
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        facts["numpy"] = getattr(numpy, "__version__", None)
    if echo is not None:
        facts["echo_version"] = getattr(echo, "__version__", None)
        facts["echo_path"] = getattr(echo, "__file__", None)
    facts.update(cpu=cpu_model(), cpus=os.cpu_count(), commit=git_commit())
    return facts


# --------------------------------------------------------------------------- arguments, output


def bounded_int(what: str, limit: int) -> Callable[[str], int]:
    """An argparse type: a whole number in [1, ``limit``]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
        if not 1 <= value <= limit:
            raise argparse.ArgumentTypeError(f"{what} must be in [1, {limit}], got {value}")
        return value

    return parse


def int_list(what: str, limit: int) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated whole numbers, each in [1, ``limit``]; a single
    number is a list of one."""
    one = bounded_int(what, limit)

    def parse(text: str) -> list[int]:
        values = [one(x) for x in text.split(",") if x.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"{what}: no number in {text!r}")
        return values

    return parse


def bench_parser(
    doc: str | None, quick_help: str, max_seconds: float, label: str = "echo-<version>"
) -> argparse.ArgumentParser:
    """A benchmark script's parser with the options they all take: ``--quick``, ``--json``,
    ``--label`` and ``--max-seconds`` (the watchdog)."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n", 1)[0])
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--json", type=Path, default=None, help="write results as JSON to PATH")
    p.add_argument("--label", default=None, help=f"name of this run (default: {label})")
    p.add_argument(
        "--max-seconds", type=float, default=max_seconds, help="hard limit for the run (s)"
    )
    return p


def write_json(path: Path | str, doc: Any, say: bool = True) -> Path:
    """Writes ``doc`` as indented JSON (creating the folder); prints ``wrote PATH``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    if say:
        print(f"wrote {path}")
    return path


def run_json_child(cmd: Sequence[str], timeout_s: float) -> dict[str, Any]:
    """Runs the script command line ``cmd`` with ``--json TMP`` added (its output goes to
    ours) and returns what it wrote there; ``{"error": ...}`` where it wrote nothing."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "child.json"
        try:
            proc = subprocess.run([*cmd, "--json", str(path)], timeout=timeout_s, check=False)
            doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        except (subprocess.SubprocessError, OSError, ValueError) as e:
            return {"error": f"{type(e).__name__}: {e}"}
        if proc.returncode != 0:
            doc.setdefault("exit_status", proc.returncode)
        return doc


# --------------------------------------------------------------------------- numbers, tables


def timed_loop(
    fn: Callable[[], object], seconds: float, max_iters: int, warmup: int = 2
) -> tuple[int, float]:
    """Calls ``fn`` ``warmup`` times untimed, then until ``max_iters`` calls or ``seconds``
    have passed; returns (timed calls, elapsed seconds)."""
    for _ in range(warmup):
        fn()
    count, start = 0, time.perf_counter()
    deadline = start + seconds
    while count < max_iters:
        fn()
        count += 1
        if time.perf_counter() >= deadline:
            break
    return count, time.perf_counter() - start


def rate(count: float, seconds: float) -> float:
    """``count / seconds``, NaN for an empty interval."""
    return count / seconds if seconds > 0 else math.nan


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def fmt_num(v: Any, fmt: str, width: int) -> str:
    """``v`` formatted with ``fmt`` right-aligned in ``width``, or ``-`` where it is missing
    (None, NaN, not a number)."""
    return f"{v:>{width}{fmt}}" if _is_num(v) else f"{'-':>{width}}"


def fmt_ratio(a: Any, b: Any, width: int) -> str:
    """``a / b`` as ``1.23x``, or ``-`` where either is missing, NaN or ``b`` is 0."""
    return f"{(f'{a / b:.2f}x' if _is_num(a) and _is_num(b) and b else '-'):>{width}}"


def print_columns(rows: Sequence[Sequence[object]]) -> None:
    """Prints ``rows`` as left-aligned columns, each as wide as its widest cell."""
    if not rows:
        return
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
