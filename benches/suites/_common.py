"""What the suites share: ``/proc`` readers (RSS), a raw wire-protocol-v1 peer, a counter of
the ``echo`` logger's records, a watchdog, a connection flooder run in its own process, and
small number and table helpers. Standard library only at import time (the suites import
numpy and echo inside ``measure``). Loopback only; the flooder's process group is the only
one it ends.
"""

from __future__ import annotations

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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
HOST = "127.0.0.1"
MAGIC = b"ECHO"
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
        [sys.executable, "-m", "benches.suites._common", "flood", str(port), str(seconds)],
        cwd=ROOT,
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


# --------------------------------------------------------------------------- numbers, tables


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


def failed_rows(results: dict[str, Any], width: int) -> list[list[str]]:
    """One row per side whose run failed: its error in the second column."""
    return [
        [side, str(r["error"])[:120], *["-"] * (width - 2)]
        for side, r in results.items()
        if "error" in r
    ]


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "flood":
    print(json.dumps(flood(int(sys.argv[2]), float(sys.argv[3]))), flush=True)
