"""echo: a very fast replay buffer for distributed reinforcement learning.

Samples go into a pre-allocated, lockfree Rust ring buffer; the learner gets whole batches back
as zero-copy, read-only numpy views while the GIL is released.
"""

from __future__ import annotations

import atexit
from typing import TYPE_CHECKING

from echo import _echo
from echo._echo import (
    DETAILED_METRICS,
    ConnectionClosedError,
    HistSnapshot,
    SampleInfo,
    SampleWriter,
    ServerClosedError,
    SharedMemoryError,
    __version__,
    reset_log_cache,
)
from echo.checkpoint import CheckpointError
from echo.client import TcpClient
from echo.compression import Lz4, Zstd
from echo.ragged import Packed, Padded, Ragged
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

if TYPE_CHECKING:
    from echo.metrics import MetricsEndpoint

__all__ = [
    "DETAILED_METRICS",
    "CheckpointError",
    "ConnectionClosedError",
    "Fifo",
    "HistSnapshot",
    "Lifo",
    "Lz4",
    "MinPriority",
    "MinSize",
    "Packed",
    "Padded",
    "Prioritized",
    "Queue",
    "Ragged",
    "Sample",
    "SampleInfo",
    "SampleToInsertRatio",
    "SampleWriter",
    "Sequence",
    "Server",
    "ServerClosedError",
    "SharedMemoryError",
    "TcpClient",
    "TcpTransport",
    "TrajectoryAccumulator",
    "Uniform",
    "Zstd",
    "__version__",
    "reset_log_cache",
    "serve_metrics",
]


def serve_metrics(
    *servers: Server,
    port: int = 9464,
    host: str = "127.0.0.1",
    max_connections: int = 8,
    timeout: float = 5.0,
) -> MetricsEndpoint:
    """Serves the servers' Prometheus metrics over HTTP: `echo.metrics.serve_metrics`.

    Imports `echo.metrics` (and so `prometheus_client`, the `metrics` extra) only when called,
    so `import echo` works without it. See `echo.metrics.serve_metrics` for the arguments.

    Raises:
        ImportError: prometheus_client is not installed (`pip install 'id-echo[metrics]'`).
    """
    from echo.metrics import serve_metrics as serve

    return serve(*servers, port=port, host=host, max_connections=max_connections, timeout=timeout)


# Threads still waiting inside echo when the interpreter shuts down, and transport threads that
# log through Python, must not take the GIL during finalisation (CPython would unwind them
# through Rust frames): see src/python/mod.rs.
atexit.register(_echo._interpreter_exiting)  # pyright: ignore[reportPrivateUsage]
