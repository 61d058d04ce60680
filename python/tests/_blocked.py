"""Telling that a call is blocked, for the tests and for the child processes they start.

A blocked `sample()`/`submit()` waits in slices of at most 50 ms (so Ctrl-C works). On a
replay server each slice that ends without progress adds its wait to `sample_blocked_ns_total`
or `insert_blocked_ns_total`: once that counter has grown while nothing could unblock the call,
the call is blocked, not merely slow to start. The FIFO ring shows no such counter in
`stats()`; a native `ServerCore._waiting() -> (inserts, samples)`, the threads parked in the
core right now, would show it and is used where it exists. Otherwise (and for `TcpClient`, which
has no counter either) a call counts as blocked once it has had `BLOCKED_S` to get there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

# How long a call without a counter must stay blocked before we believe it is waiting.
BLOCKED_S = 0.3

# `stats()` field that grows while a call of this kind is blocked on a replay server, and its
# index in `ServerCore._waiting()`.
_REPLAY_COUNTER = {"submit": "insert_blocked_ns_total", "sample": "sample_blocked_ns_total"}
_WAITING_INDEX = {"submit": 0, "sample": 1}


def after(seconds: float) -> Callable[[], bool]:
    """A probe that holds once `seconds` have passed: for calls no counter shows blocked."""
    until = time.monotonic() + seconds
    return lambda: time.monotonic() >= until


def blocked(server: Any, call: str, count: int = 1) -> Callable[[], bool]:
    """A probe that holds once a `call` (`"sample"` or `"submit"`) on `server` that started
    before this probe is blocked: on a replay server, once its blocked-time counter grew; on a
    FIFO server, once `count` such calls are parked (or, without `_waiting`, after BLOCKED_S)."""
    core = server._core
    if core.max_size is not None:
        field = _REPLAY_COUNTER[call]
        before = getattr(server.stats(), field)
        return lambda: getattr(server.stats(), field) > before
    waiting = getattr(core, "_waiting", None)
    if waiting is None:
        return after(BLOCKED_S)
    index = _WAITING_INDEX[call]
    return lambda: waiting()[index] >= count


def wait_for(probe: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Polls `probe` until it holds (True) or `timeout` seconds passed (False)."""
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def announce_when(probe: Callable[[], bool], timeout: float = 30.0) -> None:
    """Prints `ready` from a watcher thread once `probe()` holds (`never blocked` if it does
    not within `timeout`), for a parent process waiting for that line; the calling thread goes
    on to block."""

    def watch() -> None:
        print("ready" if wait_for(probe, timeout) else "never blocked", flush=True)

    threading.Thread(target=watch, daemon=True).start()
