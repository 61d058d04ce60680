"""Issue #11, finding 5 (idle connections lock workers out at ``max_connections``): with
``TcpTransport(0, host="127.0.0.1", max_connections=64)`` and 64 idle raw connections (each
read the handshake, then sent nothing), time one ``TcpClient`` connect + ``send()`` +
``wait()`` for its ack. Reported: the outcome (ok, or the exception), its time, how many of
the 64 idle connections the server closed, and the server's eviction/refusal counters where
they exist. Run under "after" and "before", interleaved; each child bounded to 60 s.

Usage::

    python benches/tools/issue11_lockout.py [--rounds 2] [--json /tmp/issue11-lockout.json]
"""

from __future__ import annotations

import argparse
import select
import sys
import time
from typing import Any

import _issue11 as c

MAX = 64


def child(args: argparse.Namespace) -> dict[str, Any]:
    echo = c.import_echo()
    import numpy as np

    c.watchdog(55.0)
    logs = c.install_log_counter()
    example = {"x": np.zeros(16, np.float32)}
    server = echo.Server(
        example,
        batch_size=1,
        num_buffers=4,
        transport=echo.TcpTransport(0, host=c.HOST, max_connections=MAX),
    )
    server.start()
    idle = [c.raw_peer(server.port)[0] for _ in range(MAX)]
    time.sleep(0.2)
    t0 = time.monotonic()
    outcome = "ok"
    try:
        client = echo.TcpClient(c.HOST, server.port, example, connect_timeout=5.0)
        t_connect = time.monotonic() - t0
        client.send({"x": np.ones(16, np.float32)}, timeout=5.0)
        client.wait(timeout=5.0)
        client.close()
    except Exception as e:  # noqa: BLE001 -- reported, not fatal
        outcome = f"{type(e).__name__}: {e}"
        t_connect = None
    elapsed = time.monotonic() - t0
    time.sleep(0.2)
    readable, _, _ = select.select(idle, [], [], 0.0)
    closed = 0
    for s in readable:
        try:
            if s.recv(1) == b"":
                closed += 1
        except OSError:
            closed += 1
    st = server.stats()
    doc = {
        **c.echo_facts(echo),
        "outcome": outcome,
        "seconds": round(elapsed, 4),
        "connect_seconds": None if t_connect is None else round(t_connect, 4),
        "idle_closed_by_server": closed,
        "evicted_total": getattr(st, "connections_evicted_total", None),
        "refused_total": getattr(st, "connections_refused_total", None),
        "inserted": st.samples_inserted_total,
        "echo_log": logs.counts,
        "echo_log_first": logs.first,
    }
    for s in idle:
        s.close()
    server.close()
    return doc


def report(results: list[dict[str, Any]]) -> None:
    print(
        f"# finding 5: max_connections={MAX}, {MAX} idle raw connections, then TcpClient"
        " connect+send+ack"
    )
    print(
        f"{'side':8} {'round':>5} {'seconds':>8} {'idle closed':>11} {'evicted':>7}"
        f" {'refused':>7} {'load1':>6}  outcome"
    )
    for d in results:
        if "outcome" not in d:
            print(f"{d['side']:8} error: {d.get('error')} {d.get('stderr_tail', '')[-300:]}")
            continue
        print(
            f"{d['side']:8} {d['round']:>5} {d['seconds']:>8.3f} {d['idle_closed_by_server']:>11}"
            f" {d['evicted_total']!s:>7} {d['refused_total']!s:>7}"
            f" {d['load_start'][0]:>6.2f}  {d['outcome']}"
        )
        print(f"   log records: {d['echo_log']}; first of each: {d.get('echo_log_first')}")


if __name__ == "__main__":
    sys.exit(c.main("lockout", child, report, default_rounds=2, child_timeout=60.0))
