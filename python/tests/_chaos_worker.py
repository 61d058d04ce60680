"""The peers of `test_chaos.py`: raw wire-v1 sockets, no `echo` import.

Usage: `python _chaos_worker.py PORT ROLE WORKER_ID SEED`

Every role speaks protocol v1 itself (docs/guides/tcp.md, "Wire protocol v1"), so the test
knows exactly which bytes went out and which acknowledgements came back, even of a process
that is SIGKILLed. Roles:

- `worker`: a rollout worker. Sends real samples (`make_payload`), reads the acknowledgements
  and prints one line `A <id hex>` per acknowledged sample, flushed, *after* the ack byte was
  read: a line the test receives names a sample the server acknowledged. The seed picks how it
  ends: SIGKILL of itself in the middle of the handshake, in the middle of a sample (part of
  the payload written), or right after reading an ack; a clean close after every ack; or
  running until the test SIGKILLs it (a self-kill is announced first: `kill <how>`). A
  connection that fails (refused, evicted before its first sample) is replaced by a new one;
  a sample is never sent twice, so no sample can arrive twice.
- `noread`: sends real samples and never reads an acknowledgement (its receive buffer as small
  as the kernel allows), then either closes or waits to be killed.
- `garbage`: connects over and over and sends random bytes: floods of whole "samples" closed
  cleanly (acknowledged, so they occupy the ingress), or odd sizes in random chunks, sometimes
  before the handshake, sometimes reading acks, closing or resetting at
  random points. Its bytes never contain 0xEC, so no garbage sample carries the `MAGIC` of a
  real id, whatever its alignment.
- `idle`: keeps `WORKER_ID` connections open that never send a byte (the server's slots),
  replacing every one the server evicts, at most every `IDLE_ROUND_S`. Prints `held <n>`
  after every round; the line `pause` on stdin stops the replacing (answered `paused`).

Every role stops by itself after `LIFETIME_S` at the latest.
"""

from __future__ import annotations

import os
import random
import select
import signal
import socket
import struct
import sys
import time

import numpy as np

# The layout: {"data": uint32[DATA_LEN], "id": uint64[]}; optree flattens dict keys sorted,
# so a payload is the data bytes, then the id bytes. 64 KiB per sample.
DATA_LEN = 16382
PAYLOAD = DATA_LEN * 4 + 8
HANDSHAKE = b"ECHO" + struct.pack("<BI", 1, 2) + struct.pack("<III", 4, 1, DATA_LEN)
HANDSHAKE += struct.pack("<II", 8, 0)
OFFER_LEN = 38

# id = MAGIC << 48 | worker << 32 | conn << 24 | seq. No garbage byte is 0xEC (the top byte).
MAGIC = 0xEC41
MAX_CONN = 1 << 8
MAX_SEQ = 1 << 24

LIFETIME_S = 150.0
IDLE_ROUND_S = 0.25

_BASE = np.arange(DATA_LEN, dtype=np.uint32)
_MASK64 = (1 << 64) - 1


def make_id(worker: int, conn: int, seq: int) -> int:
    assert 0 <= worker < 1 << 16
    assert 0 <= conn < MAX_CONN
    assert 0 <= seq < MAX_SEQ
    return MAGIC << 48 | worker << 32 | conn << 24 | seq


def split_id(sample_id: int) -> tuple[int, int, int] | None:
    """(worker, conn, seq) of a real id, or None when the id lacks `MAGIC`."""
    if sample_id >> 48 != MAGIC:
        return None
    return (sample_id >> 32) & 0xFFFF, (sample_id >> 24) & 0xFF, sample_id & (MAX_SEQ - 1)


def make_data(sample_id: int) -> np.ndarray:
    """The data leaf of sample `sample_id`: every element depends on the whole id (splitmix64),
    so a torn, spliced or shifted payload does not match."""
    z = (sample_id + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    mult, add = np.uint32((z & 0xFFFFFFFF) | 1), np.uint32(z >> 32)
    return _BASE * mult + add


def make_payload(sample_id: int) -> bytes:
    return make_data(sample_id).tobytes() + struct.pack("<Q", sample_id)


def _die(how: str) -> None:
    _report(f"kill {how}")
    os.kill(os.getpid(), signal.SIGKILL)


def _report(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _connect(port: int, timeout: float) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed by the server")
        data += chunk
    return data


def _handshake(sock: socket.socket) -> None:
    """The greeting as a v1 client reads it: the handshake, then the server's offer of wire
    v2 (38 bytes, none of them an ack byte), skipped."""
    got = _recv_exact(sock, len(HANDSHAKE))
    if got != HANDSHAKE:
        raise SystemExit(f"unexpected handshake {got!r}")
    offer = _recv_exact(sock, OFFER_LEN)
    if offer[:6] != b"ECHO\x02o" or b"\x01" in offer:
        raise SystemExit(f"unexpected offer {offer!r}")


# --- worker -----------------------------------------------------------------------------------

ENDINGS = ("kill_handshake", "kill_mid_sample", "kill_after_ack", "close", "run")


def run_worker(port: int, worker: int, rng: random.Random, deadline: float) -> None:
    ending = rng.choice(ENDINGS)
    window = rng.choice((1, 2, 4, 8))
    # How many acks (or whole samples, for kill_mid_sample) before the ending; at most a few
    # connections (refused, evicted) are tolerated before it.
    target = rng.randrange(0, 40)
    _report(f"ending {ending} {target} {window}")
    acked = 0
    sent_total = 0
    for conn in range(MAX_CONN):
        if time.monotonic() > deadline:
            return
        if conn:
            time.sleep(rng.uniform(0.01, 0.1))
        try:
            sock = _connect(port, timeout=20.0)
        except OSError:
            continue
        try:
            if ending == "kill_handshake":
                part = rng.randrange(0, len(HANDSHAKE))
                _recv_exact(sock, part)
                _die("kill_handshake")
            _handshake(sock)
            seq = 0
            inflight: list[int] = []  # ids sent on this connection, not yet acknowledged
            while time.monotonic() < deadline:
                if ending == "kill_mid_sample" and sent_total >= target:
                    partial = make_payload(make_id(worker, conn, seq))
                    sock.sendall(partial[: rng.randrange(1, PAYLOAD)])
                    if rng.random() < 0.5:
                        time.sleep(rng.uniform(0, 0.05))
                    _die("kill_mid_sample")
                done_sending = ending == "close" and sent_total > target
                if done_sending and not inflight:
                    sock.close()  # every sample acknowledged: a clean close
                    _report("closed")
                    return
                if len(inflight) < window and not done_sending:
                    sample_id = make_id(worker, conn, seq)
                    sock.sendall(make_payload(sample_id))
                    inflight.append(sample_id)
                    seq += 1
                    sent_total += 1
                    continue
                got = sock.recv(len(inflight))
                if not got:
                    raise ConnectionError("closed by the server")
                if set(got) != {1}:
                    raise SystemExit(f"unexpected ack bytes {got!r}")
                for _ in got:
                    _report(f"A {inflight.pop(0):x}")
                    acked += 1
                    if ending == "kill_after_ack" and acked > target:
                        _die("kill_after_ack")
        except (OSError, ConnectionError):
            sock.close()
            continue
    _report("out of connections")


# --- noread -----------------------------------------------------------------------------------


def run_noread(port: int, worker: int, rng: random.Random, deadline: float) -> None:
    count = rng.randrange(1, 200)
    for conn in range(MAX_CONN):
        if time.monotonic() > deadline:
            return
        try:
            sock = _connect(port, timeout=20.0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
            _handshake(sock)
            for seq in range(count):
                if time.monotonic() > deadline:
                    return
                sock.sendall(make_payload(make_id(worker, conn, seq)))
        except (OSError, ConnectionError):
            time.sleep(0.05)
            continue
        _report(f"sent {count}")
        if rng.random() < 0.5:
            sock.close()
            return
        time.sleep(max(0.0, deadline - time.monotonic()))  # the test kills it
        return


# --- garbage ----------------------------------------------------------------------------------


def _garbage(rng: random.Random, n: int) -> bytes:
    data = bytearray(rng.randbytes(n))
    return bytes(data).replace(b"\xec", b"\x00")


def run_garbage(port: int, rng: random.Random, deadline: float) -> None:
    block = memoryview(_garbage(rng, 4 * PAYLOAD))
    for _ in range(100_000):
        if time.monotonic() > deadline:
            return
        try:
            sock = _connect(port, timeout=1.0)
        except OSError:
            time.sleep(0.05)
            continue
        try:
            sock.settimeout(rng.uniform(0.05, 0.5))
            if rng.random() < 0.7:
                _recv_exact(sock, rng.randrange(0, len(HANDSHAKE) + 1))
            if rng.random() < 0.5:
                # A flood: a few whole "samples" (no more than fit in the connection's queue),
                # then a clean close: the server queues and acknowledges them all, and the
                # connection ends. Without a byte budget such samples would pile up in memory
                # for as long as the learner is behind.
                for _ in range(rng.randrange(1, 9)):
                    offset = rng.randrange(0, 3 * PAYLOAD)
                    sock.sendall(block[offset : offset + PAYLOAD])
                sock.shutdown(socket.SHUT_WR)
                continue
            total = rng.choice((rng.randrange(1, 64), PAYLOAD, rng.randrange(1, 6 * PAYLOAD)))
            chunk = rng.choice((1, 7, 4096, PAYLOAD, 3 * PAYLOAD))
            if chunk < 4096:
                total = min(total, 100)
            sent = 0
            while sent < total:
                n = min(total - sent, chunk)
                offset = rng.randrange(0, 3 * PAYLOAD)
                sock.sendall(block[offset : offset + n])
                sent += n
            if rng.random() < 0.3:
                sock.recv(4096)  # some acks, maybe
            if rng.random() < 0.2:
                time.sleep(rng.uniform(0, 0.3))
            if rng.random() < 0.5:  # reset instead of a clean close
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except (OSError, ConnectionError):
            pass
        finally:
            sock.close()


# --- idle -------------------------------------------------------------------------------------


def run_idle(port: int, target: int, deadline: float) -> None:
    held: list[socket.socket] = []
    paused = False
    opened = 0
    next_round = time.monotonic()
    while time.monotonic() < deadline:
        wait = max(0.0, next_round - time.monotonic())
        ready, _, _ = select.select([*held, sys.stdin], [], [], wait)
        for sock in ready:
            if sock is sys.stdin:
                line = sys.stdin.readline()
                if line.strip() == "pause":
                    paused = True
                    _report("paused")
                elif line.strip() == "resume":
                    paused = False
                    _report("resumed")
                elif not line:
                    return
                continue
            try:
                alive = bool(sock.recv(4096))  # the handshake, or EOF once evicted
            except OSError:
                alive = False
            if not alive:
                held.remove(sock)
                sock.close()
        if time.monotonic() < next_round:
            continue
        next_round = time.monotonic() + IDLE_ROUND_S
        while not paused and len(held) < target and opened < 20_000:
            try:
                sock = _connect(port, timeout=5.0)
            except OSError:
                break
            sock.setblocking(False)
            held.append(sock)
            opened += 1
        _report(f"held {len(held)}")


def main(argv: list[str]) -> int:
    port, role, worker, seed = int(argv[1]), argv[2], int(argv[3]), int(argv[4])
    signal.alarm(int(LIFETIME_S) + 30)  # never outlive a broken test for long
    deadline = time.monotonic() + LIFETIME_S
    rng = random.Random(seed)
    if role == "worker":
        run_worker(port, worker, rng, deadline)
    elif role == "noread":
        run_noread(port, worker, rng, deadline)
    elif role == "garbage":
        run_garbage(port, rng, deadline)
    elif role == "idle":
        run_idle(port, worker, deadline)
    else:
        raise SystemExit(f"unknown role {role!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
