"""Shared pieces of the issue #11 closing-note measurements (``issue11_*.py`` next to this
file): the driver that runs one measurement under two interpreters, interleaved, each child
in its own process group under a timeout; ``/proc`` readers; a raw wire-protocol-v1 peer;
a counter of the ``echo`` logger's records. Stdlib only (numpy and echo are imported by the
children themselves). Loopback only; the driver ends only the process groups it started.

A measurement script calls :func:`main` with a ``child`` function. Run without ``--child`` it
is the driver: for each round it runs ``INTERPRETER SCRIPT --child --side NAME [extra]`` for
every side, alternating which side goes first, reads the JSON document the child prints as its
last stdout line, and writes every document (plus load averages) to ``--json``. A child that
cannot ``import echo`` (the extension being rebuilt) exits with :data:`IMPORT_FAILED`; the
driver waits and retries it a few times.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
MAGIC = b"ECHO"
AFTER = "/work/main/.venv/bin/python"
BEFORE = "/work/before/venv/bin/python"
IMPORT_FAILED = 5
MIB = 1 << 20


# --------------------------------------------------------------------------- /proc, load


def status_kib(*keys: str) -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in keys:
                out[key] = int(value.split()[0])
    return out


def rss_mib() -> float:
    return status_kib("VmRSS")["VmRSS"] / 1024.0


def malloc_trim() -> bool:
    """glibc ``malloc_trim(0)``: gives freed heap memory back to the OS, so RSS that stays
    after it is held, not merely cached by the allocator. False where unavailable."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


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


# --------------------------------------------------------------------------- echo import


def import_echo() -> Any:
    """``import echo``, or exit with IMPORT_FAILED so the driver retries later."""
    try:
        import echo
    except ImportError as e:
        print(f"import echo failed: {e}", file=sys.stderr)
        sys.exit(IMPORT_FAILED)
    return echo


def echo_facts(echo: Any) -> dict[str, Any]:
    """Which echo this is: version, path, and its compiled module's size, mtime and sha256
    prefix (others rebuild the extension while we measure)."""
    import hashlib

    build = []
    for so in sorted(Path(echo.__file__).parent.glob("_echo*.so")):
        st = so.stat()
        build.append(
            {
                "file": so.name,
                "bytes": st.st_size,
                "mtime": time.strftime("%H:%M:%S", time.localtime(st.st_mtime)),
                "sha256": hashlib.sha256(so.read_bytes()).hexdigest()[:12],
            }
        )
    return {
        "python": sys.executable,
        "echo_version": getattr(echo, "__version__", None),
        "echo_path": getattr(echo, "__file__", None),
        "echo_build": build,
    }


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


# --------------------------------------------------------------------------- driver


def _run_child(
    python: str, script: str, side: str, extra: list[str], timeout: float
) -> dict[str, Any]:
    cmd = [python, script, "--child", "--side", side, *extra]
    for attempt in range(4):
        t0 = time.monotonic()
        load0 = loadavg()
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: we end exactly what we started
            cwd=str(Path(script).resolve().parent),
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return {
                "side": side,
                "python": python,
                "error": f"timed out after {timeout:.0f} s",
                "stderr_tail": err[-2000:],
            }
        if proc.returncode == IMPORT_FAILED and attempt < 3:
            print(f"  [{side}] import echo failed; retrying in 20 s", file=sys.stderr)
            time.sleep(20)
            continue
        doc: dict[str, Any] = {}
        for line in reversed(out.strip().splitlines()):
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    doc = json.loads(line)
                    break
        doc.setdefault("side", side)
        doc["python"] = python
        doc["rc"] = proc.returncode
        doc["wall_s"] = round(time.monotonic() - t0, 2)
        doc["load_start"] = load0
        doc["load_end"] = loadavg()
        if proc.returncode != 0 or "error" in doc:
            doc["stderr_tail"] = err[-2000:]
        return doc
    return {"side": side, "python": python, "error": "import echo kept failing"}


def main(
    name: str,
    child: Callable[[argparse.Namespace], dict[str, Any]],
    report: Callable[[list[dict[str, Any]]], None],
    add_args: Callable[[argparse.ArgumentParser], None] | None = None,
    sides: Callable[[argparse.Namespace], list[tuple[str, str, list[str]]]] | None = None,
    default_rounds: int = 1,
    child_timeout: float = 60.0,
) -> int:
    """The command line of a measurement script: driver by default, ``--child`` inside.

    ``sides(args)`` returns ``(label, python, extra child args)`` per side (default: after and
    before with no extra args)."""
    ap = argparse.ArgumentParser(description=(sys.modules["__main__"].__doc__ or "").split("\n")[0])
    ap.add_argument("--after", default=AFTER, help="interpreter with the current echo")
    ap.add_argument("--before", default=BEFORE, help="interpreter with the old echo")
    ap.add_argument("--rounds", type=int, default=default_rounds, help="runs per side")
    ap.add_argument("--json", default=f"/tmp/issue11-{name}.json", help="all results")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--side", default="?", help=argparse.SUPPRESS)
    if add_args:
        add_args(ap)
    args = ap.parse_args()
    if args.child:
        doc = child(args)
        doc["side"] = args.side
        print(json.dumps(doc), flush=True)
        return 0

    script = str(Path(sys.argv[0]).resolve())
    side_list = sides(args) if sides else [("after", args.after, []), ("before", args.before, [])]
    passthrough: list[str] = []
    for action in ap._actions:  # forward the script's own options to the children
        if action.dest in ("help", "after", "before", "rounds", "json", "child", "side"):
            continue
        value = getattr(args, action.dest)
        if value is not None and action.option_strings:
            passthrough += [action.option_strings[0], str(value)]
    results: list[dict[str, Any]] = []
    print(f"# {name}: load {loadavg()} (1/5/15 min) at start", file=sys.stderr)
    for r in range(args.rounds):
        order = side_list if r % 2 == 0 else list(reversed(side_list))
        for label, python, extra in order:
            print(f"  round {r + 1}: {label} ...", file=sys.stderr, flush=True)
            doc = _run_child(python, script, label, passthrough + extra, child_timeout)
            doc["round"] = r + 1
            results.append(doc)
            if "error" in doc:
                print(f"  [{label}] error: {doc['error']}", file=sys.stderr)
                if doc.get("stderr_tail"):
                    print(doc["stderr_tail"], file=sys.stderr)
    builds: dict[str, set[str]] = {}
    for doc in results:
        for b in doc.get("echo_build", []):
            builds.setdefault(doc["python"], set()).add(f"{b['sha256']} ({b['mtime']})")
    for python, shas in builds.items():
        note = "  <-- REBUILT during this run" if len(shas) > 1 else ""
        print(f"# {python}: _echo build {', '.join(sorted(shas))}{note}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    report(results)
    print(f"# load {loadavg()} at end; JSON: {args.json}")
    return 0


def watchdog(seconds: float) -> Any:
    """Ends this (child) process with status 3 after ``seconds``: the last resort."""
    import threading

    def fire() -> None:
        print(f"watchdog: over {seconds:.0f} s", file=sys.stderr, flush=True)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


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


def run_flooder(port: int, seconds: float) -> dict[str, Any]:
    """Runs :func:`flood` in a child process (this interpreter, this file), bounded."""
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "flood", str(port), str(seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=seconds + 15.0)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": "flooder timed out"}
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"flooder rc {proc.returncode}: {err[-500:]}"}


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "flood":
    print(json.dumps(flood(int(sys.argv[2]), float(sys.argv[3]))), flush=True)
