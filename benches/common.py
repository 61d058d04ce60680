"""What every benchmark shares, in one place: watchdogs and timers, logging, the facts a result
records about the machine and the checkout, ``/proc`` readers (RSS, load), argument parsing,
JSON output, child scripts that answer in JSON, a counter of the ``echo`` logger's records, a
raw wire-protocol-v1 peer, a connection flooder run in its own process, and number and table
helpers.

Standard library only, so that any interpreter runs it: ours, the other echo's virtualenv of
``python -m benches --compare``, the Reverb/TorchRL virtualenv of
``benches/suites/replay_peers.py``, the docs virtualenv that renders the records (the suites
import numpy and echo inside ``measure``). The suites and scripts import it as
``benches.common``; a script that also runs on its own is started as ``python -m
benches.suites.NAME`` from the repository root, and the tools in ``benches/tools`` put the
repository root on ``sys.path`` first. Loopback only; the flooder's process group is the only
one it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import queue
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent  # the repository root
HOST = "127.0.0.1"
MAGIC = b"ECHO"
MIB = 1 << 20

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


def watchdog(seconds: float) -> threading.Timer:
    """A suite child's watchdog: ends this process with status 3 after ``seconds``."""
    return start_watchdog(seconds, "benches child", status=3)


def under_watchdog(seconds: float, fn: Callable[[], T]) -> T:
    """``fn()`` under :func:`watchdog` ``(seconds)``, cancelled once it returns: a suite's
    ``measure``, which the tests also call in-process and then go on."""
    timer = watchdog(seconds)
    try:
        return fn()
    finally:
        timer.cancel()


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
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
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
    """The 1/5/15-minute load average, to 0.01 (another busy process skews every number);
    None where the platform has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def status_kib(*keys: str) -> dict[str, int]:
    """:func:`proc_kib` of this process's ``/proc/self/status``."""
    return proc_kib("/proc/self/status", *keys)


def rss_mib() -> float:
    """This process's resident set size in MiB."""
    return status_kib("VmRSS")["VmRSS"] / 1024.0


def malloc_trim() -> bool:
    """glibc ``malloc_trim(0)``: gives freed heap memory back to the OS, so RSS that stays
    after it is held, not merely cached by the allocator. False where unavailable."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def settle_rss(max_s: float = 10.0, quiet_s: float = 0.6, step: float = 0.1) -> float:
    """Polls RSS until it has not changed by more than 1 MiB for ``quiet_s`` (or ``max_s``)."""
    t_end = time.monotonic() + max_s
    last = rss_mib()
    stable_since = time.monotonic()
    while time.monotonic() < t_end:
        time.sleep(step)
        now = rss_mib()
        if abs(now - last) > 1.0:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since >= quiet_s:
            break
    return rss_mib()


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
    """Runs the script command line ``cmd`` from the repository root (so ``python -m
    benches.suites.NAME`` finds it) with ``--json TMP`` added (its output goes to ours) and
    returns what it wrote there; ``{"error": ...}`` where it wrote nothing."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "child.json"
        try:
            proc = subprocess.run(
                [*cmd, "--json", str(path)], cwd=ROOT, timeout=timeout_s, check=False
            )
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


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``xs`` by nearest rank; NaN when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def median(xs: list[float]) -> float:
    return percentile(xs, 50)


def num(v: Any, fmt: str = ",.0f") -> str:
    """A table cell: ``v`` formatted, or ``-`` when it is not a number."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        return "-"
    return format(v, fmt)


def span(xs: Sequence[float], fmt: str = ".2f") -> str:
    """A table cell: ``min..max`` of ``xs`` (the per-repeat ratios), ``-`` when empty."""
    return f"{min(xs):{fmt}}..{max(xs):{fmt}}" if xs else "-"


def failed_rows(results: dict[str, Any], width: int) -> list[list[str]]:
    """One row per side whose run failed: its error in the second column."""
    return [
        [side, str(r["error"])[:120], *["-"] * (width - 2)]
        for side, r in results.items()
        if "error" in r
    ]


# --------------------------------------------------------------------------- echo logger


class LogCounter(logging.Handler):
    """Counts log records by logger name and level (installed on the root logger, so nothing
    is printed: the default last-resort handler is not used while a handler exists)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: dict[str, int] = {}
        self.first: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        key = f"{record.name}:{record.levelname}"
        self.counts[key] = self.counts.get(key, 0) + 1
        if key not in self.first:
            with contextlib.suppress(Exception):
                self.first[key] = record.getMessage()[:200]

    def warnings(self, prefix: str = "echo") -> int:
        return sum(
            n
            for key, n in self.counts.items()
            if key.split(":")[0].split(".")[0] in (prefix, "_" + prefix)
            and key.split(":")[1] in ("WARNING", "ERROR", "CRITICAL")
        )


def install_log_counter() -> LogCounter:
    counter = LogCounter()
    root = logging.getLogger()
    root.addHandler(counter)
    root.setLevel(logging.WARNING)
    return counter


# --------------------------------------------------------------------------- raw wire peer


def read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"EOF after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_handshake(sock: socket.socket) -> int:
    """Reads a wire v1 handshake; returns the payload size of one sample in bytes."""
    head = read_exact(sock, 9)
    if head[:4] != MAGIC or head[4] != 1:
        raise ValueError(f"not an echo v1 handshake: {head!r}")
    (n_arrays,) = struct.unpack("<I", head[5:9])
    size = 0
    for _ in range(n_arrays):
        dtype_size, ndim = struct.unpack("<II", read_exact(sock, 8))
        dims = struct.unpack(f"<{ndim}I", read_exact(sock, 4 * ndim)) if ndim else ()
        n = 1
        for d in dims:
            n *= d
        size += dtype_size * n
    return size


def raw_peer(port: int, timeout: float = 10.0) -> tuple[socket.socket, int]:
    """A connected socket that has read the handshake, and the payload size."""
    sock = socket.create_connection((HOST, port), timeout=timeout)
    try:
        return sock, read_handshake(sock)
    except BaseException:
        sock.close()
        raise


# --------------------------------------------------------------------------- connection flooder


def flood(port: int, seconds: float) -> dict[str, Any]:
    """Opens and closes connections to ``port`` as fast as one thread can for ``seconds``:
    each connect, then one read (EOF, a reset, or data when the server admitted it), then
    close. Counts the outcomes."""
    counts = {
        "eof": 0,
        "reset": 0,
        "data": 0,
        "read_timeout": 0,
        "connect_refused": 0,
        "connect_error": 0,
    }
    first_error = ""
    t0 = time.monotonic()
    t_end = t0 + seconds
    while time.monotonic() < t_end:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(2.0)
        try:
            s.connect((HOST, port))
        except ConnectionRefusedError:
            counts["connect_refused"] += 1
            s.close()
            continue
        except OSError as e:
            counts["connect_error"] += 1
            first_error = first_error or f"{type(e).__name__}: {e}"
            s.close()
            continue
        try:
            data = s.recv(64)
            counts["eof" if data == b"" else "data"] += 1
        except (ConnectionResetError, ConnectionAbortedError):
            counts["reset"] += 1
        except TimeoutError:
            counts["read_timeout"] += 1
        except OSError as e:
            counts["connect_error"] += 1
            first_error = first_error or f"{type(e).__name__}: {e}"
        s.close()
    elapsed = time.monotonic() - t0
    done = counts["eof"] + counts["reset"] + counts["data"]
    return {
        "seconds": round(elapsed, 3),
        "per_s": round(done / elapsed, 1),
        **counts,
        "first_error": first_error,
    }


def run_group(cmd: Sequence[str], timeout_s: float) -> tuple[int, str, str] | None:
    """Runs ``cmd`` from the repository root in a session (process group) of its own and
    waits for it: (exit status, stdout, stderr), or None when it ran past ``timeout_s`` and
    its process group, the only one this ends, was killed."""
    proc = subprocess.Popen(
        list(cmd),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group of the child started here
        proc.communicate()
        return None
    return proc.returncode, out, err


def last_json_line(out: str) -> Any:
    """The JSON document on the last line of ``out`` (a child's answer); ValueError if none."""
    lines = out.strip().splitlines()
    if not lines:
        raise ValueError("no output")
    return json.loads(lines[-1])


def run_flooder(port: int, seconds: float) -> dict[str, Any]:
    """Runs :func:`flood` in a child process (this interpreter, this file), bounded."""
    cmd = [sys.executable, "-m", "benches.common", "flood", str(port), str(seconds)]
    done = run_group(cmd, seconds + 15.0)
    if done is None:
        return {"error": "flooder timed out"}
    rc, out, err = done
    try:
        return last_json_line(out)
    except ValueError:
        return {"error": f"flooder rc {rc}: {err[-500:]}"}


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "flood":
    print(json.dumps(flood(int(sys.argv[2]), float(sys.argv[3]))), flush=True)


class LineWorkers:
    """Worker processes (one command each, run from the repository root) and a reader thread
    per process for their stdout lines, which a driver expects word by word."""

    def __init__(self, commands: list[list[str]], cwd: Path) -> None:
        self.lines: queue.Queue[tuple[int, str]] = queue.Queue()
        self.procs: list[subprocess.Popen[str]] = []
        self.pumps: list[threading.Thread] = []
        # Lines read, not yet expected.
        self.inbox: list[list[str]] = [[] for _ in commands]
        env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
        for wid, cmd in enumerate(commands):
            proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=cwd
            )
            self.procs.append(proc)
            pump = threading.Thread(target=self._pump, args=(wid, proc), daemon=True)
            pump.start()
            self.pumps.append(pump)

    def _pump(self, wid: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.put((wid, line.strip()))
        self.lines.put((wid, "eof"))

    def expect(self, word: str, timeout: float) -> list[str]:
        """The next line starting with ``word`` of every worker (in worker order); lines read
        while waiting are kept for later calls."""
        deadline = time.monotonic() + timeout
        for _ in range(10**9):
            if all(any(x.split(" ", 1)[0] == word for x in box) for box in self.inbox):
                out = []
                for box in self.inbox:
                    i = next(i for i, x in enumerate(box) if x.split(" ", 1)[0] == word)
                    out.append(box.pop(i))
                return out
            left = deadline - time.monotonic()
            try:
                wid, line = (
                    self.lines.get(timeout=max(left, 0.0)) if left > 0 else self.lines.get_nowait()
                )
            except queue.Empty:
                raise TimeoutError(f"not every worker said {word!r} in {timeout:g} s") from None
            if line == "eof":
                raise RuntimeError(f"worker {wid} ended before saying {word!r}")
            self.inbox[wid].append(line)
        raise AssertionError("unreachable")

    def tell(self, line: str) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(line + "\n")
            proc.stdin.flush()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        deadline = time.monotonic() + 10.0
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()  # by PID: only the processes this pool started
                proc.wait(timeout=10.0)
        # Each pump ends at its worker's EOF; then its pipe is closed here, not left to the
        # garbage collector (a ResourceWarning where warnings are errors: the tests).
        for proc, pump in zip(self.procs, self.pumps, strict=True):
            pump.join(timeout=5.0)
            if not pump.is_alive() and proc.stdout is not None:
                proc.stdout.close()
