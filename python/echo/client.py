"""The rollout-worker side: `TcpClient` streams samples to a `Server`'s `TcpTransport`."""

from __future__ import annotations

from typing import Any

from echo._echo import TcpSender
from echo._pytree import TreeLayout
from echo._validate import check_int

__all__ = ["TcpClient"]


class TcpClient:
    """Sends samples to an echo server over TCP (wire-compatible with id-echo 0.2.1).

    Connecting reads the server's handshake and checks that it stores samples shaped like
    `data_sample`. Each `send()` writes the sample's leaves straight from their numpy buffers
    (one vectored write, no joined copy). At most `max_inflight_msgs` samples are in flight
    unacknowledged; `send()` blocks (GIL released, Ctrl-C honoured) beyond that.

    Args:
        host: Server host name or address.
        port: Server port.
        data_sample: A pytree like the server's example (same structure, shapes and dtypes).
        max_inflight_msgs: Unacknowledged samples allowed before `send()` blocks.
        connect_timeout: Seconds to wait for the connection and the handshake.

    Raises:
        ValueError: The server's handshake is not echo's, or describes another layout.
        ConnectionClosedError: The server closed the connection during the handshake (for
            example, because it is at `max_connections`).
        OSError: Connecting failed (e.g. `ConnectionRefusedError`).
    """

    def __init__(
        self,
        host: str,
        port: int,
        data_sample: Any,
        max_inflight_msgs: int = 32,
        *,
        connect_timeout: float = 10.0,
    ) -> None:
        max_inflight_msgs = check_int("max_inflight_msgs", max_inflight_msgs, 1, 2**32 - 1)
        self._layout = TreeLayout(data_sample)
        self._sender = TcpSender(host, port, self._layout, max_inflight_msgs, connect_timeout)
        self._closed = False

    def send(self, sample: Any, *, timeout: float | None = None) -> None:
        """Sends one sample.

        Args:
            sample: A pytree with `data_sample`'s structure, shapes and dtypes.
            timeout: Seconds to wait for room in the in-flight window; `None` waits as long
                as it takes.

        Raises:
            ValueError: Wrong structure or shape (nothing is sent).
            TypeError: A leaf is not a numpy array or has another dtype (nothing is sent).
            ConnectionClosedError: After `close()`, or once the server is gone.
            TimeoutError: The window stayed full for `timeout` seconds (nothing is sent).
        """
        # A flat-dict sample is looked up by key natively; anything else is flattened by the
        # layout.
        self._sender.send(sample, timeout)

    def send_many(self, samples: Any, *, timeout: float | None = None) -> None:
        """Sends each sample of an iterable in order (e.g. one per vectorised environment)."""
        for sample in samples:
            self.send(sample, timeout=timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until every sent sample is acknowledged by the server.

        Raises:
            ConnectionClosedError: The server went away first.
            TimeoutError: Not everything was acknowledged within `timeout` seconds.
        """
        self._sender.wait(timeout)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Flushes, then closes the connection. Idempotent; leaves no thread behind.

        Waits (at most `timeout` seconds) until everything sent is acknowledged, so samples
        sent just before `close()` are delivered. Returns whether they all were.
        """
        self._closed = True
        return self._sender.close(timeout)

    @property
    def sent(self) -> int:
        """Samples sent so far."""
        return self._sender.sent

    @property
    def acked(self) -> int:
        """Samples the server has acknowledged so far."""
        return self._sender.acked

    def __enter__(self) -> TcpClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TcpClient(sent={self.sent}, acked={self.acked}, closed={self._closed})"
