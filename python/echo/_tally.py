"""What `echo.metrics` exports that the native counters (`Server.stats()`) do not hold: the
learner's waiting time (live, including a wait in progress and waits that timed out), the
batches handed out, and checkpoint outcomes. Kept by the Python half of `Server`, once per
`sample()` or `checkpoint()` call, never per sample."""

from __future__ import annotations

import threading
import time


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
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wait_ns = 0  # completed waits
        self._waiting_since_ns = 0  # monotonic ns when the wait in progress began; 0: none
        self._reported_wait_ns = 0  # the largest value `learner_wait_ns` returned
        self.batches = 0  # batches `sample()` handed out
        self.checkpoints = 0  # checkpoints completed
        self.checkpoint_failures = 0  # `checkpoint()` calls that raised

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
