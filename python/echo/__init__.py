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
from echo.client import TcpClient
from echo.server import Sample, Server, stop_all_transports
from echo.transport import TcpTransport

__all__ = [
    "ConnectionClosedError",
    "HistSnapshot",
    "Sample",
    "SampleInfo",
    "Server",
    "ServerClosedError",
    "TcpClient",
    "TcpTransport",
    "__version__",
]


def _at_exit() -> None:
    # Stop transports (their threads must not call into Python during finalisation), then
    # keep threads still waiting inside echo from re-taking the GIL (CPython would unwind them
    # through Rust frames): see src/python/mod.rs.
    stop_all_transports()
    _echo._interpreter_exiting()  # pyright: ignore[reportPrivateUsage]


atexit.register(_at_exit)
