"""Issue #11, finding 9 (a connection flood at ``max_connections``: one log record per
refusal, a small backlog): how fast a full server accepts-and-refuses.

The server: ``TcpTransport(0, host="127.0.0.1", max_connections=16)``, its 16 slots held by
16 working ``TcpClient``s (each sent one sample, acknowledged, and stays connected). A flooder
(one thread in its own process, stdlib only) opens and closes as many connections as it can
for ``--seconds`` (3 s): connect, one read (EOF or reset: refused; data: admitted), close.
The same flooder also runs against a plain Python listener in this process
(``socket.create_server``, a thread that accepts and closes at once), before and after the
echo flood. Reported: connections/s for each, the outcomes, the WARNING records the echo
logger produced during the flood, and ``connections_refused_total`` where it exists.

Run under "after" and "before", interleaved; each child bounded to 60 s.

Usage::

    python benches/tools/issue11_accept_flood.py [--rounds 2] [--json /tmp/issue11-flood.json]
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from typing import Any

import _issue11 as c

MAX = 16


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--seconds", type=float, default=3.0)


def plain_flood(seconds: float) -> dict[str, Any]:
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


def child(args: argparse.Namespace) -> dict[str, Any]:
    echo = c.import_echo()
    import numpy as np

    c.watchdog(55.0)
    logs = c.install_log_counter()
    example = {"x": np.zeros(16, np.float32)}
    plain1 = plain_flood(args.seconds)
    server = echo.Server(
        example,
        batch_size=MAX,
        num_buffers=2,
        transport=echo.TcpTransport(0, host=c.HOST, max_connections=MAX),
    )
    server.start()
    clients = []
    for i in range(MAX):
        cl = echo.TcpClient(c.HOST, server.port, example, connect_timeout=5.0)
        cl.send({"x": np.full(16, i, np.float32)}, timeout=5.0)
        cl.wait(timeout=5.0)
        clients.append(cl)
    time.sleep(0.3)
    warn0 = logs.warnings()
    counts0 = dict(logs.counts)
    res = c.run_flooder(server.port, args.seconds)
    time.sleep(0.5)  # records logged as the last refusals happen
    res["echo_warnings"] = logs.warnings() - warn0
    res["log_delta"] = {
        k: v - counts0.get(k, 0) for k, v in logs.counts.items() if v != counts0.get(k, 0)
    }
    res["log_first"] = logs.first
    st = server.stats()
    res["refused_total"] = getattr(st, "connections_refused_total", None)
    res["evicted_total"] = getattr(st, "connections_evicted_total", None)
    res["active_connections"] = st.active_connections
    res["inserted"] = st.samples_inserted_total
    for cl in clients:
        cl.close(timeout=2.0)
    server.close()
    plain2 = plain_flood(args.seconds)
    return {**c.echo_facts(echo), "echo": res, "plain_before": plain1, "plain_after": plain2}


def report(results: list[dict[str, Any]]) -> None:
    print(
        f"# finding 9: flood of connect+read+close for 3 s at a full server"
        f" (max_connections={MAX}, all working); connections/s seen by the flooder"
    )
    print(
        f"{'side':8} {'round':>5} {'echo /s':>8} {'plain /s':>15} {'echo/plain':>10}"
        f" {'eof':>6} {'reset':>6} {'data':>4} {'refusedSYN':>10} {'err':>4}"
        f" {'WARN recs':>9} {'refused_total':>13} {'load1':>6}"
    )
    for d in results:
        if "echo" not in d or "per_s" not in d["echo"]:
            print(
                f"{d['side']:8} error: {d.get('error')} {d.get('echo')}"
                f" {d.get('stderr_tail', '')[-300:]}"
            )
            continue
        e = d["echo"]
        p1, p2 = d["plain_before"].get("per_s", 0.0), d["plain_after"].get("per_s", 0.0)
        pm = (p1 + p2) / 2
        print(
            f"{d['side']:8} {d['round']:>5} {e['per_s']:>8.0f} {f'{p1:.0f}/{p2:.0f}':>15}"
            f" {e['per_s'] / pm if pm else float('nan'):>10.2f} {e['eof']:>6} {e['reset']:>6}"
            f" {e['data']:>4} {e['connect_refused']:>10} {e['connect_error']:>4}"
            f" {e['echo_warnings']:>9} {e['refused_total']!s:>13} {d['load_start'][0]:>6.2f}"
        )
        if e.get("first_error"):
            print(f"   first error: {e['first_error']}")
        print(f"   log records during the flood: {e['log_delta']}")


if __name__ == "__main__":
    sys.exit(
        c.main("flood", child, report, add_args=add_args, default_rounds=2, child_timeout=60.0)
    )
