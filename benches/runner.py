"""Running a measurement in a child process, for ``python -m benches`` (:mod:`benches.front`)
and the core suite (:mod:`benches.suites.core`): the child runs in a session (process group)
of its own from the repository root, its output lines are streamed to a callback and to a log
file, and past its time limit the whole group is ended (SIGTERM, then SIGKILL). Also the
progress bars (tqdm, optional) that messages print above.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from benches.common import ROOT

try:
    import tqdm as _tqdm
except ImportError:  # progress bars are optional
    _tqdm = None

MAX_EVENTS = 50_000_000  # output lines and 0.25 s ticks per child (its deadline comes first)
KILL_GRACE_S = 15.0  # a child still running this long past its own watchdog is ended


def tqdm_missing() -> bool:
    """Whether tqdm (the progress bars) is not installed."""
    return _tqdm is None


# --------------------------------------------------------------------------- progress


class _NoBar:
    """Stands in for a tqdm bar when progress is off."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def set_description_str(self, desc: str = "", refresh: bool = True) -> None:
        pass

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


class Progress:
    """Progress bars (tqdm) on stderr, or none; messages go above the bars either way."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and _tqdm is not None

    def bar(self, total: int, desc: str, unit: str, position: int, leave: bool) -> Any:
        if not self.enabled or _tqdm is None:
            return _NoBar()
        return _tqdm.tqdm(
            total=total,
            desc=desc,
            unit=unit,
            position=position,
            leave=leave,
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0.2,
        )

    def say(self, msg: str) -> None:
        if self.enabled and _tqdm is not None:
            _tqdm.tqdm.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)


def _end_group(proc: subprocess.Popen[str]) -> None:
    """Ends the child's process group: the child, which runs in a session of its own, and
    whatever it started that is still there. SIGTERM, then SIGKILL after 5 s."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return  # nothing of that group is left
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)


def run_child(
    cmd: list[str],
    log_path: Path,
    timeout_s: float,
    on_line: Callable[[str, str], None],
    tick: Callable[[], None],
) -> tuple[int | None, bool]:
    """Runs ``cmd`` in ``ROOT``, streaming its output lines to ``on_line(stream, line)`` and
    to ``log_path``; returns (exit status or None, timed out)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
    timed_out = False
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,
        )

        def pump(stream: IO[str] | None, name: str) -> None:
            if stream is not None:
                for line in stream:
                    lines.put((name, line))
            lines.put((name, None))

        pumps = [
            threading.Thread(target=pump, args=(proc.stdout, "out"), daemon=True),
            threading.Thread(target=pump, args=(proc.stderr, "err"), daemon=True),
        ]
        for t in pumps:
            t.start()
        open_streams = len(pumps)
        deadline = time.monotonic() + timeout_s
        exited_at: float | None = None
        try:
            for _ in range(MAX_EVENTS):
                if not open_streams or time.monotonic() >= deadline:
                    break
                if exited_at is None and proc.poll() is not None:
                    exited_at = time.monotonic()
                if exited_at is not None and time.monotonic() - exited_at > 5.0:
                    break  # something the child started still holds its pipes
                try:
                    name, line = lines.get(timeout=0.25)
                except queue.Empty:
                    tick()
                    continue
                if line is None:
                    open_streams -= 1
                    continue
                log.write(line if name == "out" else f"[stderr] {line}")
                on_line(name, line.rstrip("\n"))
                tick()
        except BaseException:  # Ctrl-C, SIGTERM (see main): take the child down with us
            _end_group(proc)
            raise
        if not open_streams:  # its output is closed: it is exiting, give it the time to
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        if proc.poll() is None:
            timed_out = True
            log.write(f"[benches] over {timeout_s:.0f} s: ending the process group\n")
        if proc.poll() is None or open_streams:
            _end_group(proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10.0)
        for t in pumps:
            t.join(timeout=2.0)
        for _ in range(1_000_000):  # whatever is left in the queue
            try:
                name, line = lines.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                log.write(line if name == "out" else f"[stderr] {line}")
        log.write(f"[benches] exit status {proc.returncode}\n")
    return proc.returncode, timed_out
