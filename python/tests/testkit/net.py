"""What the TCP test files share: raw-socket reads and taking a number of batches."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from conftest import WAIT_S

from echo import Server

LOCALHOST = "127.0.0.1"


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Up to `n` bytes: fewer only when the peer closed first."""
    data = b""
    for _ in range(n + 1):
        if len(data) == n:
            break
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def take(
    server: Server, num_batches: int, batch_ids: Callable[[Any], list[int]], timeout: float = WAIT_S
) -> list[int]:
    """The ids of the next `num_batches` batches, each checked whole by `batch_ids`."""
    ids: list[int] = []
    for _ in range(num_batches):
        sample = server.sample(timeout=timeout)
        assert sample is not None, "the server was closed"
        ids += batch_ids(sample.batch)
    return ids
