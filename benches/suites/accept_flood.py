"""Accept flood: how fast a full server accepts and refuses connections.

The server, ``TcpTransport(0, host="127.0.0.1", max_connections=16)``, has its 16 slots held
by 16 working ``TcpClient``s (each sent one sample, acknowledged, and stays connected). A
flooder (one thread in its own process, standard library only) opens and closes as many
connections as it can for ``seconds``: connect, one read (EOF or reset: refused; data:
admitted), close. The same flooder also runs against a plain Python listener
(``socket.create_server``, a thread that accepts and closes at once) before and after, the
reference. Reported: connections/s for each, the outcomes, the echo logger's WARNING records
during the flood (one per refusal would flood the log) and ``connections_refused_total``.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from benches import common as c

MAX = 16


def parameters(quick: bool) -> dict[str, Any]:
    return {"seconds": 1.0 if quick else 3.0, "max_connections": MAX}


def limit_s(params: dict[str, Any]) -> float:
    return 3 * float(params["seconds"]) + 60.0


def _plain_flood(seconds: float) -> dict[str, Any]:
    srv = socket.create_server((c.HOST, 0), backlog=128)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    stop = threading.Event()
    accepted = [0]

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            conn.close()
            accepted[0] += 1

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    res = c.run_flooder(port, seconds)
    stop.set()
    t.join(2.0)
    srv.close()
    res["server_accepted"] = accepted[0]
    return res


def measure(params: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    import echo

    seconds, slots = float(params["seconds"]), int(params["max_connections"])
    c.watchdog(limit_s(params))
    logs = c.install_log_counter()
    example = {"x": np.zeros(16, np.float32)}
    plain_before = _plain_flood(seconds)
    server = echo.Server(
        example,
        batch_size=slots,
        num_buffers=2,
        transport=echo.TcpTransport(0, host=c.HOST, max_connections=slots),
    )
    server.start()
    clients = []
    for i in range(slots):
        cl = echo.TcpClient(c.HOST, server.port, example, connect_timeout=5.0)
        cl.send({"x": np.full(16, i, np.float32)}, timeout=5.0)
        cl.wait(timeout=5.0)
        clients.append(cl)
    warn0 = logs.warnings()
    res = c.run_flooder(server.port, seconds)
    time.sleep(0.5)  # records logged as the last refusals happen
    res["echo_warnings"] = logs.warnings() - warn0
    st = server.stats()
    res["refused_total"] = getattr(st, "connections_refused_total", None)
    res["active_connections"] = st.active_connections
    for cl in clients:
        cl.close(timeout=2.0)
    server.close()
    plain_after = _plain_flood(seconds)
    return {
        "echo": res,
        "plain_before": plain_before,
        "plain_after": plain_after,
        "correct": res.get("data", 1) == 0 and "per_s" in res,
    }


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    columns = [
        "echo",
        "echo conn/s",
        "plain socket conn/s",
        "echo / plain",
        "refused (EOF/reset)",
        "admitted",
        "WARNING records",
        "connections_refused_total",
    ]
    rows = c.failed_rows(results, len(columns))
    for side, r in results.items():
        if "error" in r:
            continue
        e = r["echo"]
        plain = (r["plain_before"].get("per_s", 0.0) + r["plain_after"].get("per_s", 0.0)) / 2
        rows.append(
            [
                side,
                c.num(e.get("per_s")),
                c.num(plain),
                c.num(e["per_s"] / plain if plain else None, ".2f"),
                f"{e.get('eof', 0) + e.get('reset', 0):,}",
                str(e.get("data")),
                str(e.get("echo_warnings")),
                str(e.get("refused_total")),
            ]
        )
    return [
        {
            "title": "Connection flood at a full server (max_connections="
            f"{params['max_connections']}, every slot working), {params['seconds']:g} s",
            "columns": columns,
            "rows": rows,
            "notes": [
                "*plain socket*: the same flooder against a Python listener that accepts and "
                "closes at once (the mean of a run before and after echo's)."
            ],
        }
    ]
