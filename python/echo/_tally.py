"""What `echo.metrics` exports that the native counters (`Server.stats()`) do not hold: the
learner's waiting time (live, including a wait in progress and waits that timed out), the
batches handed out, checkpoint outcomes, and when the server started counting (with, for a
restored server, the counters it started from). Kept by the Python half of `Server`, once per
`sample()` or `checkpoint()` call, never per sample."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from echo._echo import SampleInfo


class Tally:
    """Counters one `Server` keeps in Python; read by `echo.metrics` when scraped."""

    __slots__ = (
        "_lock",
        "_reported_wait_ns",
        "_wait_ns",
        "_waiting_since_ns",
        "batches",
        "checkpoint_failures",
        "checkpoints",
        "started",
        "started_unix_s",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wait_ns = 0  # completed waits
        self._waiting_since_ns = 0  # monotonic ns when the wait in progress began; 0: none
        self._reported_wait_ns = 0  # the largest value `learner_wait_ns` returned
        self.batches = 0  # batches `sample()` handed out
        self.checkpoints = 0  # checkpoints completed
        self.checkpoint_failures = 0  # `checkpoint()` calls that raised
        # When the server started counting (Unix seconds): its creation, or the end of the
        # restore that made it. `echo_server_start_time_seconds`.
        self.started_unix_s = time.time()
        # A restored server's `stats()` as its restore ended: the totals the checkpoint
        # carried over, which the exported counters leave out (a new process counts from 0).
        # `None` for a server built by the constructor, whose counters start at 0.
        self.started: SampleInfo | None = None

    def restarted(self, stats: SampleInfo) -> None:
        """Called as `Server.restore` returns, with the new server's `stats()`: the exported
        counters count from here, from 0, as a restarted process's do."""
        self.started = stats
        self.started_unix_s = time.time()

    def begin_wait(self) -> int:
        """Called as `sample()` starts waiting; returns the start for `end_wait`."""
        start = time.monotonic_ns()
        with self._lock:
            self._waiting_since_ns = start
        return start

    def end_wait(self, start_ns: int, batch_wait_ns: int | None) -> None:
        """Called as `sample()` returns: `batch_wait_ns` is the batch's `info.wait_ns` (the
        native measurement), `None` when no batch came (timeout, close, an error), in which
        case the whole call counts."""
        with self._lock:
            self._waiting_since_ns = 0
            if batch_wait_ns is None:
                self._wait_ns += time.monotonic_ns() - start_ns
            else:
                self._wait_ns += batch_wait_ns
                self.batches += 1

    def learner_wait_ns(self) -> int:
        """Nanoseconds `sample()` calls have waited, the wait in progress included. Never
        smaller than a value returned before (the live part is measured in Python, the
        completed part natively, and the two differ by the microseconds around the wait)."""
        with self._lock:
            total = self._wait_ns
            if self._waiting_since_ns:
                total += time.monotonic_ns() - self._waiting_since_ns
            total = max(total, self._reported_wait_ns)
            self._reported_wait_ns = total
            return total
