"""Transports: where a `Server` gets samples from besides `submit()`."""

from __future__ import annotations

from dataclasses import dataclass, field

from echo._validate import check_bool, check_int, check_seconds, check_str, check_token

__all__ = ["TcpTransport"]


@dataclass(frozen=True)
class TcpTransport:
    """TCP ingress for rollout workers (`TcpClient`s), wire-compatible with id-echo 0.2.1.

    It speaks wire protocol 2 (typed layout check, priorities, tokens, reconnecting clients,
    heartbeats) with echo clients and protocol 1 with id-echo 0.2.1 clients, negotiated per
    connection; with a token it speaks only protocol 2 (see the TCP guide).

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
            Same-host shared-memory segments (about 8 MiB each for large samples) count
            against it too, and together may take at most half of it: a client that would
            need more uses TCP (`shared_memory=None`) or gets `SharedMemoryError` saying so
            (`True`). Besides this, each connection that sends uses a read buffer of at most
            64 KiB.
        token: A shared secret clients must prove (HMAC-SHA256 challenge-response: the token
            never crosses the wire). `None` reads the environment variable `ECHO_TOKEN` when
            the server starts (unset or empty: no token). With a token, protocol-1 clients,
            clients without the token and clients with another one are refused before any
            sample is accepted. Not shown in `repr()`.
        heartbeat_timeout: Seconds a protocol-2 client may stay silent before its connection
            is taken for dead (clients send heartbeats when idle); `None` never.
        session_timeout: Seconds the server keeps a protocol-2 client's session (its queue
            and how many of its samples are stored) after its connection dropped, so that a
            reconnecting client resumes exactly once and in order.
        shared_memory: Offer protocol-2 clients on this machine (Linux) the same-host
            shared-memory path: the worker writes each sample into a ring in shared memory
            and the server copies it once into its queue, with the TCP connection kept for
            liveness. `False` serves every client over TCP (a client with
            `shared_memory=True` then gets a `SharedMemoryError` saying so).
    """

    port: int
    num_threads: int = 8
    host: str = "0.0.0.0"
    max_connections: int = 4096
    max_buffered_bytes: int = 1 << 30
    token: str | None = field(default=None, repr=False, kw_only=True)
    heartbeat_timeout: float | None = field(default=10.0, kw_only=True)
    session_timeout: float = field(default=300.0, kw_only=True)
    shared_memory: bool = field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        check_int("port", self.port, 0, 65535)
        check_int("num_threads", self.num_threads, 1, 1024)
        check_int("max_connections", self.max_connections, 1, 2**32 - 1)
        check_int("max_buffered_bytes", self.max_buffered_bytes, 1, 2**63 - 1)
        check_str("host", self.host)
        check_token("token", self.token)
        check_seconds("heartbeat_timeout", self.heartbeat_timeout, optional=True)
        check_seconds("session_timeout", self.session_timeout, optional=False)
        check_bool("shared_memory", self.shared_memory)
