"""echo: a very fast replay buffer for distributed reinforcement learning.

Samples go into a pre-allocated, lockfree Rust ring buffer; the learner gets whole batches back
as zero-copy, read-only numpy views while the GIL is released.
"""

from __future__ import annotations

import atexit

from echo import _echo
from echo._echo import (
    ConnectionClosedError,
    HistSnapshot,
    SampleInfo,
    ServerClosedError,
    __version__,
)
from echo.server import Sample, Server

__all__ = [
    "ConnectionClosedError",
    "HistSnapshot",
    "Sample",
    "SampleInfo",
    "Server",
    "ServerClosedError",
    "__version__",
]

# Threads still waiting inside echo when the interpreter shuts down must not re-take the GIL
# (CPython would unwind them through Rust frames): see src/python/mod.rs.
atexit.register(_echo._interpreter_exiting)  # pyright: ignore[reportPrivateUsage]
