"""The HTTP server behind `echo.serve_metrics`: a WSGI server with a bounded number of
handler threads, each connection's reads and writes bounded in time.

The server `prometheus_client.start_http_server` runs starts one thread per connection, with
no timeout and a listen backlog of 5: a few hundred connections that send half a request
each hold a few hundred threads for good. This one bounds what a peer can hold, as the TCP
transport's accept loop does (`src/transport/tcp/accept.rs`):

- At most `max_connections` connections are served at once, each by its own thread; the
  threads of finished connections are joined before new ones start, so the endpoint never
  has more than `max_connections` handler threads alive.
- Every read and write of a connection waits at most `timeout` seconds.
- When every slot is taken, the oldest connection still sending its request (a stalled or
  slow peer; a scrape sends its request in one go) is closed, and the newcomer waits up to
  `EVICTION_GRACE_S` for its slot. If no connection is still sending its request, or the
  slot does not come free in time, the newcomer is closed at once.
- The listen backlog is `BACKLOG`, so a burst of scrapers waits in the kernel's queue.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

__all__ = ["BACKLOG", "EVICTION_GRACE_S", "HANDLER_THREAD_NAME", "MetricsHTTPServer"]

_log = logging.getLogger("echo.metrics")

BACKLOG = 128
"""The listen backlog (the kernel caps it at `net.core.somaxconn`)."""

EVICTION_GRACE_S = 1.0
"""How long a newcomer waits for the slot of the connection closed for it."""

HANDLER_THREAD_NAME = "echo-metrics-handler"
"""The name of every thread that serves one connection."""

_JOIN_S = 5.0  # a finished handler thread has only its return left to run


class _Handler(WSGIRequestHandler):
    """Serves one connection: one request, its reads and writes bounded by the server's
    `timeout`; says when the request has arrived; logs nothing per request."""

    def setup(self) -> None:
        super().setup()
        # Every recv and send of this connection waits at most this long.
        self.connection.settimeout(self._server.timeout_s)

    @property
    def _server(self) -> MetricsHTTPServer:
        return cast("MetricsHTTPServer", self.server)

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        # The request line and headers are read: from now on the connection is being
        # answered and is not closed for a newcomer. One closed for a newcomer while it
        # was still sending is not answered.
        return self._server.request_received(self.connection) and parsed

    def log_message(self, format: str, *args: Any) -> None:
        """Logs nothing (a scrape every few seconds would fill the log)."""


class MetricsHTTPServer(WSGIServer):
    """A WSGI server serving `app` on `(host, port)` with at most `max_connections` handler
    threads, each read or write waiting at most `timeout_s` (see the module doc)."""

    request_queue_size = BACKLOG

    def __init__(
        self,
        host: str,
        port: int,
        app: Callable[..., Any],
        *,
        max_connections: int,
        timeout_s: float,
    ) -> None:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        # Read by TCPServer.__init__ when it makes the listening socket (IPv6 hosts too).
        self.address_family = family
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._slot_freed = threading.Condition(self._lock)
        # Connections being served whose request has not all arrived, oldest first: the ones
        # closed for a newcomer.
        self._receiving: dict[socket.socket, None] = {}
        self._sockets: set[socket.socket] = set()  # every connection being served
        self._handlers: set[threading.Thread] = set()  # handler threads started, not joined
        self._finished: list[threading.Thread] = []  # handler threads done with their slot
        self._serving = 0  # slots taken: at most max_connections
        self._closing = False
        super().__init__((cast("str", sockaddr[0]), port), _Handler, bind_and_activate=True)
        self.set_app(app)

    # -- called by the handler threads ----------------------------------------------------

    def request_received(self, connection: socket.socket) -> bool:
        """The request on `connection` has arrived; `False` if it was closed meanwhile."""
        with self._lock:
            if connection not in self._receiving:
                return False
            del self._receiving[connection]
            return True

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except OSError:
            # A connection that timed out, was closed for a newcomer or went away: the
            # peer's business (socketserver would print a traceback).
            _log.debug("metrics endpoint: connection from %s ended", client_address, exc_info=True)
        except Exception:  # noqa: BLE001 -- logged; the endpoint keeps serving the others
            _log.exception("metrics endpoint: serving %s failed", client_address)
        finally:
            with self._lock:
                self._receiving.pop(request, None)
                self._sockets.discard(request)
            self.shutdown_request(request)
            with self._lock:
                self._serving -= 1
                self._finished.append(threading.current_thread())
                self._slot_freed.notify_all()

    # -- called by the accept loop (serve_forever's thread) ----------------------------------

    def process_request(self, request: Any, client_address: Any) -> None:
        connection = cast("socket.socket", request)
        if not self._take_slot():
            self.shutdown_request(connection)
            return
        with self._lock:
            finished, self._finished = self._finished, []
            self._handlers.difference_update(finished)
            self._receiving[connection] = None
            self._sockets.add(connection)
        # Threads that gave their slot back are joined before another starts, so at most
        # `max_connections` handler threads are ever alive.
        for thread in finished:
            thread.join(_JOIN_S)
        thread = threading.Thread(
            target=self.process_request_thread,
            args=(connection, client_address),
            name=HANDLER_THREAD_NAME,
            daemon=True,
        )
        with self._lock:
            self._handlers.add(thread)
        try:
            thread.start()
        except BaseException:
            with self._lock:
                self._handlers.discard(thread)
                self._receiving.pop(connection, None)
                self._sockets.discard(connection)
                self._serving -= 1
            self.shutdown_request(connection)
            raise

    def _take_slot(self) -> bool:
        """Takes a slot for a newcomer: at once if one is free; else closes the oldest
        connection still sending its request and waits up to `EVICTION_GRACE_S` for a slot.
        `False` (the newcomer is refused) if none came free."""
        with self._lock:
            if self._serving >= self.max_connections and not self._closing:
                if self._receiving:
                    oldest = next(iter(self._receiving))
                    del self._receiving[oldest]
                    _close_now(oldest)
                deadline = time.monotonic() + EVICTION_GRACE_S
                while self._serving >= self.max_connections and not self._closing:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._slot_freed.wait(left)
            if self._closing or self._serving >= self.max_connections:
                return False
            self._serving += 1
            return True

    # -- called by MetricsEndpoint.close() -------------------------------------------------

    def close_connections(self, timeout: float) -> None:
        """Closes every connection being served and joins the handler threads (waiting up to
        `timeout` seconds in all); the accept loop must have stopped."""
        with self._lock:
            self._closing = True
            self._slot_freed.notify_all()
            for connection in self._sockets:
                _close_now(connection)
            threads = list(self._handlers)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _close_now(connection: socket.socket) -> None:
    """Ends `connection` for its handler thread, whose blocked read or write returns at once
    (the thread closes the socket itself)."""
    with contextlib.suppress(OSError):  # already closed by the peer
        connection.shutdown(socket.SHUT_RDWR)
