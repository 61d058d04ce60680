"""What the TCP test files share: raw-socket reads, a wire-v2 handshake by hand and taking a
number of batches."""

from __future__ import annotations

import os
import socket
import struct
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


# A leaf as a wire-v2 hello describes it: name, byte order, kind, itemsize, dimensions
# (a ragged leaf's: `ragged_dims`).
HelloLeaf = tuple[str, bytes, bytes, int, list[int]]


def ragged_dims(max_len: int, group_first: int, inner: tuple[int, ...] = ()) -> list[int]:
    """A ragged leaf's dimensions in a hello: 0xFFFFFFFF, its `max_len`, the index of the
    first leaf of its length group (its own when alone), then its inner shape."""
    return [0xFFFFFFFF, max_len, group_first, *inner]


HELLO_NOTICES = 4
HELLO_CODECS = 8
HELLO_PARAMS = 32


def v2_handshake(
    port: int, leaves: list[HelloLeaf], flags: int = HELLO_NOTICES, rcvbuf: int | None = None
) -> socket.socket:
    """A raw connection that completes wire v2's handshake by hand, its hello describing
    `leaves` (sorted by name, as the server's layout is) with `flags`; `rcvbuf` shrinks its
    receive buffer before it connects (a peer that stops reading fills it at once)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(5)
    sock.connect((LOCALHOST, port))
    offer = recv_exact(sock, 38)
    assert offer[:6] == b"ECHO\x02o", offer
    session = os.urandom(16)  # a worker of its own
    body = bytes([flags]) + session + struct.pack("<QI", 0, 0) + bytes(16)
    body += struct.pack("<I", len(leaves))
    for name, order, kind, size, dims in leaves:
        body += struct.pack("<H", len(name)) + name.encode() + order + kind
        body += struct.pack("<II", size, len(dims)) + b"".join(struct.pack("<I", d) for d in dims)
    sock.sendall(offer[6:] + b"ECHO\x02" + struct.pack("<I", len(body)) + body)
    reply = sock.recv(4096)
    assert reply[:6] == b"ECHO\x02\x00", reply
    return sock
