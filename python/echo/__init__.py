"""echo: a very fast replay buffer for distributed reinforcement learning.

Samples go into a pre-allocated, lockfree Rust ring buffer; the learner gets whole batches back
as zero-copy, read-only numpy views while the GIL is released.
"""

from __future__ import annotations

import atexit

from echo import _echo
from echo._echo import (
    DETAILED_METRICS,
    ConnectionClosedError,
    HistSnapshot,
    SampleInfo,
    ServerClosedError,
    SharedMemoryError,
    __version__,
    reset_log_cache,
)
from echo.checkpoint import CheckpointError
from echo.client import TcpClient
from echo.replay import (
    Fifo,
    Lifo,
    MinPriority,
    MinSize,
    Prioritized,
    Queue,
    SampleToInsertRatio,
    Sequence,
    Uniform,
)
from echo.server import Sample, Server
from echo.trajectory import TrajectoryAccumulator
from echo.transport import TcpTransport

__all__ = [
    "DETAILED_METRICS",
    "CheckpointError",
    "ConnectionClosedError",
    "Fifo",
    "HistSnapshot",
    "Lifo",
    "MinPriority",
    "MinSize",
    "Prioritized",
    "Queue",
    "Sample",
    "SampleInfo",
    "SampleToInsertRatio",
    "Sequence",
    "Server",
    "ServerClosedError",
    "SharedMemoryError",
    "TcpClient",
    "TcpTransport",
    "TrajectoryAccumulator",
    "Uniform",
    "__version__",
    "reset_log_cache",
]


# Threads still waiting inside echo when the interpreter shuts down, and transport threads that
# log through Python, must not take the GIL during finalisation (CPython would unwind them
# through Rust frames): see src/python/mod.rs.
atexit.register(_echo._interpreter_exiting)  # pyright: ignore[reportPrivateUsage]
