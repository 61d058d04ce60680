"""RSS bounds: the learner's memory over server lifetimes, and the TCP ingress's byte bound.

Lifetimes: ``Server({"x": f32[262144]}, batch_size=1, num_buffers=2,
transport=TcpTransport(0, host="127.0.0.1"))`` (1 MiB samples, a ring of two), ``start()``;
``peers`` raw-socket peers (wire v1, one thread each) connect and each send 8 samples while
the learner never samples, so the samples wait in the ingress; when RSS has settled,
``close()``, ``del server``, ``gc.collect()``, then the peers close their sockets. ``VmRSS``
after each lifetime once glibc ``malloc_trim(0)`` has returned freed memory: what stays is
held, and must not grow from one lifetime to the next.

Bound: ``bound_peers`` peers, 10 at a time, each connect, send 8 samples of 1 MiB (giving up
after 0.5 s without progress), read their acknowledgements and close, while the learner
never samples, with ``max_buffered_bytes`` at its default and at 64 MiB: RSS growth, the
peers that could send everything, ``stats().buffered_bytes``.
"""

from __future__ import annotations

import contextlib
import gc
import socket
import threading
from typing import Any

from benches import common as c

SAMPLES = 8
ELEMS = 1 << 18  # float32: 1 MiB per sample
CONCURRENT = 10


def parameters(quick: bool) -> dict[str, Any]:
    return {
        "lifetimes": 2 if quick else 3,
        "peers": 20 if quick else 60,
        "bound_peers": 30 if quick else 100,
        "bounds_mib": [None, 64],
    }


def limit_s(params: dict[str, Any]) -> float:
    return 40.0 * int(params["lifetimes"]) + 60.0 * len(params["bounds_mib"])


def _lifetime(echo: Any, example: Any, payload: bytes, peers: int) -> dict[str, Any]:
    server = echo.Server(
        example, batch_size=1, num_buffers=2, transport=echo.TcpTransport(0, host=c.HOST)
    )
    server.start()
    port = server.port
    socks: list[Any] = []
    sent = [0]
    errors: list[str] = []
    lock = threading.Lock()

    def peer() -> None:
        try:
            sock, _ = c.raw_peer(port)
            with lock:
                socks.append(sock)
            sock.settimeout(15.0)
            sock.sendall(payload)
            with lock:
                sent[0] += 1
        except Exception as e:  # noqa: BLE001 -- reported, not fatal
            with lock:
                errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=peer, daemon=True) for _ in range(peers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20.0)
    loaded = c.settle_rss(max_s=8.0)
    server.close()
    del server
    gc.collect()
    with lock:
        for s in socks:
            s.close()
    gc.collect()
    c.settle_rss(max_s=3.0)
    c.malloc_trim()
    return {
        "peers_done": sent[0],
        "errors": errors[:3],
        "rss_loaded_mib": round(loaded, 1),
        "rss_after_trim_mib": round(c.rss_mib(), 1),
    }


def _bound(
    echo: Any, example: Any, payload: bytes, peers: int, bound: int | None
) -> dict[str, Any]:
    kw = {} if bound is None else {"max_buffered_bytes": bound}
    server = echo.Server(
        example, batch_size=1, num_buffers=2, transport=echo.TcpTransport(0, host=c.HOST, **kw)
    )
    server.start()
    port = server.port
    rss0 = c.settle_rss(max_s=2.0)
    full, stalled = [0], [0]
    errors: list[str] = []
    lock = threading.Lock()

    def peer() -> None:
        try:
            sock, _ = c.raw_peer(port)
        except Exception as e:  # noqa: BLE001 -- reported, not fatal
            with lock:
                errors.append(f"connect: {type(e).__name__}: {e}")
            return
        try:
            sock.settimeout(0.5)
            sock.sendall(payload)
            with lock:
                full[0] += 1
            # Read the acks before closing: closing with unread acks would reset the
            # connection and discard what the kernel has not delivered yet.
            sock.shutdown(socket.SHUT_WR)
            got = 0
            with contextlib.suppress(OSError):
                for _ in range(SAMPLES):
                    chunk = sock.recv(SAMPLES - got)
                    if not chunk:
                        break
                    got += len(chunk)
                    if got >= SAMPLES:
                        break
        except TimeoutError:
            with lock:
                stalled[0] += 1
        except OSError as e:
            with lock:
                errors.append(f"send: {type(e).__name__}: {e}")
        finally:
            sock.close()

    for _ in range(-(-peers // CONCURRENT)):
        threads = [threading.Thread(target=peer, daemon=True) for _ in range(CONCURRENT)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15.0)
    rss1 = c.settle_rss(max_s=6.0)
    st = server.stats()
    buffered = getattr(st, "buffered_bytes", None)
    server.close()
    return {
        "max_buffered_bytes": bound,
        "growth_mib": round(rss1 - rss0, 1),
        "peers_full": full[0],
        "peers_stalled": stalled[0],
        "errors": errors[:3],
        "buffered_mib": None if buffered is None else round(buffered / c.MIB, 1),
        "samples_inserted": st.samples_inserted_total,
    }


def measure(params: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    import echo

    c.watchdog(limit_s(params))
    example = {"x": np.zeros(ELEMS, np.float32)}
    payload = np.full(ELEMS, 7.0, np.float32).tobytes() * SAMPLES  # 8 MiB per peer
    start = c.rss_mib()
    lifetimes = [
        _lifetime(echo, example, payload, int(params["peers"]))
        for _ in range(int(params["lifetimes"]))
    ]
    bounds = [
        _bound(echo, example, payload, int(params["bound_peers"]), None if b is None else b << 20)
        for b in params["bounds_mib"]
    ]
    return {
        "rss_start_mib": round(start, 1),
        "lifetimes": lifetimes,
        "bounds": bounds,
        "correct": all(not x["errors"] for x in lifetimes),
    }


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    n = int(params["lifetimes"])
    columns = ["echo", "RSS at start", *[f"lifetime {i + 1}: loaded / after" for i in range(n)]]
    life_rows = c.failed_rows(results, len(columns))
    bound_columns = [
        "echo",
        "max_buffered_bytes",
        "RSS growth",
        "peers that sent all 8",
        "peers held back",
        "buffered",
        "inserted",
    ]
    bound_rows = c.failed_rows(results, len(bound_columns))
    for side, r in results.items():
        if "error" in r:
            continue
        life_rows.append(
            [side, f"{r['rss_start_mib']:.0f} MiB"]
            + [
                f"{x['rss_loaded_mib']:.0f} / {x['rss_after_trim_mib']:.0f} MiB"
                for x in r["lifetimes"]
            ]
        )
        for b in r["bounds"]:
            bound = b["max_buffered_bytes"]
            bound_rows.append(
                [
                    side,
                    "default" if bound is None else f"{bound >> 20} MiB",
                    f"{b['growth_mib']:.0f} MiB",
                    str(b["peers_full"]),
                    str(b["peers_stalled"]),
                    c.num(b["buffered_mib"], ".0f") + " MiB",
                    str(b["samples_inserted"]),
                ]
            )
    return [
        {
            "title": f"VmRSS over server lifetimes: {params['peers']} peers x 8 x 1 MiB queued, "
            "then close; *after* is once malloc_trim(0) has run",
            "columns": columns,
            "rows": life_rows,
        },
        {
            "title": f"The ingress's byte bound: {params['bound_peers']} peers x 8 x 1 MiB, "
            "a learner that never samples",
            "columns": bound_columns,
            "rows": bound_rows,
        },
    ]
