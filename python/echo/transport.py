"""Transports: where a `Server` gets samples from besides `submit()`."""

from __future__ import annotations

from dataclasses import dataclass

from echo._validate import check_int, check_str

__all__ = ["TcpTransport"]


@dataclass(frozen=True)
class TcpTransport:
    """TCP ingress for rollout workers (`TcpClient`s), wire-compatible with id-echo 0.2.1.

    The server side runs on its own tokio runtime; each connection gets a bounded queue and
    a buffer pool, and a fixed pool of drainer threads moves samples into the ring.

    Args:
        port: Port to listen on; 0 picks a free one (read it back from `Server.port`).
        num_threads: Tokio worker threads for the sockets.
        host: Bind address: "0.0.0.0" (every interface, the default) or "127.0.0.1"
            (this machine only), or any local address.
        max_connections: Connections served at once. When all are taken, the connection that
            has been silent longest among those that have not completed a sample yet is closed
            to admit the newcomer; if every one has completed a sample, the newcomer is
            accepted and closed at once, which its client reports as a closed connection
            during the handshake (see the TCP guide).
        max_buffered_bytes: The most bytes of sample buffers the ingress holds for all
            connections together: samples acknowledged but not yet in the ring, and each
            connection's pool of empty buffers (default 1 GiB). At the bound connections stop
            reading, and so stop acknowledging, until the learner makes room; an acknowledged
            sample is never dropped. Must hold at least one sample (checked by `start()`).
            Besides this, each connection that sends uses a read buffer of at most 64 KiB.
    """

    port: int
    num_threads: int = 8
    host: str = "0.0.0.0"
    max_connections: int = 4096
    max_buffered_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        check_int("port", self.port, 0, 65535)
        check_int("num_threads", self.num_threads, 1, 1024)
        check_int("max_connections", self.max_connections, 1, 2**32 - 1)
        check_int("max_buffered_bytes", self.max_buffered_bytes, 1, 2**63 - 1)
        check_str("host", self.host)
