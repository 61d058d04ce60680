"""Which socket settings the TCP ingress should use (issue #14), measured on loopback with the
ingress's own traffic pattern rather than guessed.

A sender process writes ~196 KB samples as one vectored write of 40 leaves each (as
`TcpClient.send` does), keeping at most 32 unacknowledged (`max_inflight_msgs`); a receiver
process reads each sample whole into a buffer and answers one ack byte per sample, written
before it would wait for more data (as the server batches acks). Grid: the receiver's
`SO_RCVBUF` and the sender's `SO_SNDBUF` (kernel autotuning, i.e. not set, or fixed sizes;
setting one turns autotuning off for that socket) and `TCP_NODELAY` on both or neither.
Rounds are bounded in time and repeated in a shuffled order; the table gives the median
samples/s and GB/s of each setting and its ratio to the default (autotuning, `TCP_NODELAY`).

Run: ``python benches/tools/issue14_socket_settings.py [--seconds 1.5] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import random
import socket
import statistics
import time

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    grid = list(itertools.product(SIZES, SIZES, (True, False)))
    rates: dict[tuple[int, int, bool], list[float]] = {g: [] for g in grid}
    rng = random.Random(14)
    for _ in range(args.repeats):
        order = grid[:]
        rng.shuffle(order)
        for setting in order:
            rates[setting].append(_round(*setting, args.seconds))

    def name(size: int) -> str:
        return "auto" if size == AUTO else f"{size >> 20} MiB"

    base = statistics.median(rates[(AUTO, AUTO, True)])
    print(f"~{SAMPLE:,} B samples, window {WINDOW}, medians of {args.repeats} rounds")
    print(
        f"{'SO_RCVBUF':>10} {'SO_SNDBUF':>10} {'NODELAY':>8} {'samples/s':>11} {'GB/s':>6} "
        f"{'vs default':>10}"
    )
    for (rcv, snd, nodelay), values in rates.items():
        med = statistics.median(values)
        print(
            f"{name(rcv):>10} {name(snd):>10} {nodelay!s:>8} {med:>11,.0f} "
            f"{med * SAMPLE / 1e9:>6.2f} {med / base:>10.2f}"
        )


if __name__ == "__main__":
    main()
