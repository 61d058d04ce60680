"""Checkpoint directories over time: periodic checkpoints (`ckpt-<n>` links in one
directory, the newest kept), taken by a background thread on a schedule, and the removal of a
checkpoint with its leftovers.

How `path` is replaced atomically (a link to a sibling data directory, swapped by rename) is
the core's (`src/checkpoint/directory.rs`), as is the removal of what a replaced or killed
checkpoint leaves (`clean_leftovers`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from echo import _echo

__all__ = ["PeriodicCheckpointer", "clean_leftovers", "periodic_checkpoints"]

_log = logging.getLogger("echo")


def clean_leftovers(parent: str, name: str, keep: str | None) -> None:
    """Removes the data directories of `name` that `path` does not point at (the previous
    checkpoint, and leftovers of checkpoints killed part-way)."""
    _echo.clean_checkpoint_leftovers(parent, name, keep)


_PERIODIC_PREFIX = "ckpt-"


def periodic_checkpoints(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """The periodic checkpoints in `checkpoint_dir` (`ckpt-<n>` links), oldest first: pass
    the last one to `Server.restore`. Empty if there are none (or no such directory)."""
    root = os.fspath(checkpoint_dir)
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return []
    numbered: list[tuple[int, str]] = []
    for entry in entries:
        suffix = entry.removeprefix(_PERIODIC_PREFIX)
        if entry.startswith(_PERIODIC_PREFIX) and suffix.isdigit():
            numbered.append((int(suffix), os.path.join(root, entry)))
    return [path for _, path in sorted(numbered)]


def _remove_checkpoint(path: str) -> None:
    """Removes the checkpoint link `path`, its data directory and any leftovers of it."""
    parent, name = os.path.split(path)
    if os.path.islink(path):
        os.unlink(path)
    clean_leftovers(parent, name, keep=None)


class PeriodicCheckpointer:
    """The background thread of `Server(checkpoint_dir=..., checkpoint_every=...)`: every
    `every` seconds it calls `checkpoint(path)` with the next `checkpoint_dir/ckpt-<n>` (`n`
    one above the largest already there, so a restarted server never overwrites one), then
    deletes all but the newest `keep`. A failure is logged (logger "echo") and the next
    period tries again; the server keeps serving. `checkpoint` returns False once its server
    is gone (collected without `close()`), which ends the thread. `request_stop()` then
    `join()` end it."""

    THREAD_NAME = "echo-periodic-checkpoint"

    def __init__(
        self,
        checkpoint: Callable[[str], bool],
        checkpoint_dir: str,
        every: float,
        keep: int,
    ) -> None:
        self._checkpoint = checkpoint
        self._dir = checkpoint_dir
        self._every = every
        self._keep = keep
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.THREAD_NAME, daemon=True)

    def start(self) -> None:
        os.makedirs(self._dir, exist_ok=True)
        self._thread.start()

    def _next_path(self) -> str:
        existing = periodic_checkpoints(self._dir)
        n = (
            int(os.path.basename(existing[-1]).removeprefix(_PERIODIC_PREFIX)) + 1
            if existing
            else 0
        )
        return os.path.join(self._dir, f"{_PERIODIC_PREFIX}{n}")

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            if not self.run_once():
                return

    def run_once(self) -> bool:
        """One period's work: a checkpoint, then the rotation; every error logged. False
        once the server is gone."""
        path = self._dir
        try:
            path = self._next_path()
            if not self._checkpoint(path):
                return False
        except Exception:  # noqa: BLE001 -- logged; the server keeps serving
            if self._stop.is_set():
                _log.info("periodic checkpoint to %s abandoned: the server is closing", path)
            else:
                _log.exception("periodic checkpoint to %s failed; retrying next period", path)
            return True
        try:
            for old in periodic_checkpoints(self._dir)[: -self._keep]:
                _remove_checkpoint(old)
        except Exception:  # noqa: BLE001 -- logged; the server keeps serving
            _log.exception("removing old periodic checkpoints in %s failed", self._dir)
        return True

    def request_stop(self) -> None:
        """No checkpoint starts after this; one in progress goes on."""
        self._stop.set()

    def join(self, timeout: float) -> None:
        """Stops the thread and waits up to `timeout` seconds for a checkpoint in progress
        (which completes, or fails and removes what it wrote, once the server is closed)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                _log.warning(
                    "the periodic checkpoint thread did not stop within %.0f s; left running "
                    "as a daemon thread",
                    timeout,
                )
