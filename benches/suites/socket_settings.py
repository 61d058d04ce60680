"""Socket settings: which socket settings the TCP ingress should use, measured on loopback with
the ingress's own traffic pattern rather than guessed.

A sender process writes ~196 KB samples as one vectored write of 40 leaves each (as
`TcpClient.send` does), keeping at most 32 unacknowledged (`max_inflight_msgs`); a receiver
process reads each sample whole into a buffer and answers one ack byte per sample, written
before it would wait for more data (as the server batches acks). Grid: the receiver's
`SO_RCVBUF` and the sender's `SO_SNDBUF` (kernel autotuning, i.e. not set, or fixed sizes;
setting one turns autotuning off for that socket) and `TCP_NODELAY` on both or neither.
Rounds are bounded in time and repeated in a shuffled order; the table gives the median
samples/s and GB/s of each setting and its ratio to the default (autotuning, `TCP_NODELAY`).

Run: ``python -m benches socket-settings [--quick]``
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import random
import socket
import statistics
import time
from typing import Any

from benches import common as c

LEAVES = 40
LEAF_BYTES = 4_900
SAMPLE = LEAVES * LEAF_BYTES
WINDOW = 32
AUTO = 0  # leave the buffer size to the kernel's autotuning
SIZES = (AUTO, 1 << 20, 4 << 20)


def _configure(sock: socket.socket, option: int, size: int, nodelay: bool) -> None:
    if size != AUTO:
        sock.setsockopt(socket.SOL_SOCKET, option, size)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, int(nodelay))


def _receiver(listener: socket.socket, rcvbuf: int, nodelay: bool) -> None:
    conn, _ = listener.accept()
    _configure(conn, socket.SO_RCVBUF, rcvbuf, nodelay)
    buf = bytearray(SAMPLE)
    view = memoryview(buf)
    pending = 0
    try:
        while True:
            filled = 0
            while filled < SAMPLE:
                if pending:
                    # About to wait for data: flush the acks first, as the server does.
                    conn.setblocking(False)
                    try:
                        n = conn.recv_into(view[filled:])
                    except BlockingIOError:
                        n = -1
                    conn.setblocking(True)
                    if n == -1:
                        conn.sendall(b"\x01" * pending)
                        pending = 0
                        continue
                else:
                    n = conn.recv_into(view[filled:])
                if n == 0:
                    return
                filled += n
            pending += 1
    finally:
        conn.close()


def _round(rcvbuf: int, sndbuf: int, nodelay: bool, seconds: float) -> float:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    proc = mp.get_context("fork").Process(target=_receiver, args=(listener, rcvbuf, nodelay))
    proc.start()
    sock = socket.create_connection(("127.0.0.1", port))
    _configure(sock, socket.SO_SNDBUF, sndbuf, nodelay)
    leaves = [bytes([i]) * LEAF_BYTES for i in range(LEAVES)]
    sent = acked = 0
    deadline = time.monotonic() + seconds
    started = time.perf_counter()
    try:
        while time.monotonic() < deadline:
            while sent - acked >= WINDOW:
                acked += len(sock.recv(4096))
            remaining = [memoryview(leaf) for leaf in leaves]
            total = 0
            while total < SAMPLE:
                n = sock.sendmsg(remaining)
                total += n
                while n and remaining:
                    if n >= len(remaining[0]):
                        n -= len(remaining[0])
                        remaining.pop(0)
                    else:
                        remaining[0] = remaining[0][n:]
                        n = 0
            sent += 1
        while acked < sent:
            got = sock.recv(4096)
            if not got:
                break
            acked += len(got)
        elapsed = time.perf_counter() - started
    finally:
        sock.close()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
        listener.close()
    return acked / elapsed


def _name(size: int) -> str:
    return "auto" if size == AUTO else f"{size >> 20} MiB"


def parameters(quick: bool) -> dict[str, Any]:
    return {"seconds": 0.4 if quick else 1.5, "repeats": 1 if quick else 3, "seed": 14}


def limit_s(params: dict[str, Any]) -> float:
    rounds = len(SIZES) ** 2 * 2 * int(params["repeats"])
    return rounds * (float(params["seconds"]) + 10.0) + 30.0


def measure(params: dict[str, Any]) -> dict[str, Any]:
    grid = list(itertools.product(SIZES, SIZES, (True, False)))
    rates: dict[tuple[int, int, bool], list[float]] = {g: [] for g in grid}
    rng = random.Random(int(params["seed"]))
    for _ in range(int(params["repeats"])):
        order = grid[:]
        rng.shuffle(order)
        for setting in order:
            rates[setting].append(_round(*setting, float(params["seconds"])))
    rows = [
        {"rcvbuf": rcv, "sndbuf": snd, "nodelay": nodelay, "samples_per_s": values}
        for (rcv, snd, nodelay), values in rates.items()
    ]
    return {"sample_bytes": SAMPLE, "window": WINDOW, "rows": rows}


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    columns = ["echo", "SO_RCVBUF", "SO_SNDBUF", "TCP_NODELAY", "samples/s", "GB/s", "vs default"]
    rows = c.failed_rows(results, len(columns))
    for side, r in results.items():
        if "error" in r:
            continue
        med = {
            (x["rcvbuf"], x["sndbuf"], x["nodelay"]): statistics.median(x["samples_per_s"])
            for x in r["rows"]
        }
        base = med[(AUTO, AUTO, True)]
        for (rcv, snd, nodelay), m in med.items():
            rows.append(
                [
                    side,
                    _name(rcv),
                    _name(snd),
                    "on" if nodelay else "off",
                    c.num(m),
                    c.num(m * SAMPLE / 1e9, ".2f"),
                    c.num(m / base if base else None, ".2f"),
                ]
            )
    return [
        {
            "title": f"Loopback, ~{SAMPLE:,} B samples as one vectored write of {LEAVES} leaves, "
            f"{WINDOW} in flight; medians of {params['repeats']} round(s) of "
            f"{params['seconds']:g} s",
            "columns": columns,
            "rows": rows,
            "notes": ["*vs default*: against kernel autotuning (no buffer set) with TCP_NODELAY."],
        }
    ]
