"""A loopback TCP proxy for the wire-v2 tests (`test_wire_v2.py`): forwards, records, drops.

Usage::

    python _proxy.py --target-port N [--listen-port 0] [--seed S]
                     [--drop-prob P] [--c2s-bytes LO:HI] [--s2c-bytes LO:HI] [--max-drops K]
                     [--record-dir DIR] [--events PATH] [--lifetime SECONDS]
                     [--listen-host H] [--target-host H] [--latency-ms MS] [--rate BYTES]

It listens on ``--listen-host`` (127.0.0.1; `--listen-port 0`: a free port), prints ``port N``
on stdout as its first line, and for every connection it accepts opens one to
``--target-host:--target-port`` (127.0.0.1) and forwards bytes both ways (a half-close is
passed on as one). Other hosts than 127.0.0.1 are for the multi-host tests, which name
addresses inside the network namespaces they create.

**A slow network.** ``--latency-ms`` delays every chunk it forwards by that much (each
direction reads on only once the chunk is written, so at most 64 KiB are in flight per
direction: a bandwidth-delay product); ``--rate`` caps each direction of each connection at
that many bytes per second. Both change at run time (commands below).

**Drops at random points.** When a connection is accepted, a seeded ``random.Random(--seed)``
decides, with probability ``--drop-prob``, to drop it: it picks a direction (client to server
or server to client) and a byte budget in that direction's range (``--c2s-bytes``,
``--s2c-bytes``, inclusive). Once that many bytes went that way, the proxy forwards exactly
the budget (so a frame, a sample or a greeting is cut anywhere), then closes both sockets at
once: half of the drops with a reset (``SO_LINGER`` 0), half with a plain close. At most
``--max-drops`` connections are dropped over the proxy's life; after that everything is
forwarded untouched.

**Recording.** With ``--record-dir``, every byte received from each side is appended to
``DIR/conn<N>.c2s`` and ``DIR/conn<N>.s2c`` (N counts accepted connections from 0), also the
bytes the proxy then discards.

**Commands** on stdin, one per line, each answered by one line on stdout:

- ``drop``: reset every open connection now (``ok drop <connections>``);
- ``stall``: stop forwarding in both directions on every open connection, but keep the
  sockets open and keep reading (what arrives is discarded): a peer that went silent
  (``ok stall <connections>``);
- ``blackhole c2s`` / ``blackhole s2c``: the same for one direction only;
- ``resume``: forward again on every open connection (a stall that heals);
- ``latency MS`` / ``rate BYTES``: change the delay or the cap (0: none) (``ok latency MS``);
- ``stats``: ``stats {json}`` with counts of connections, drops and bytes;
- ``quit`` (or the end of stdin): close everything and exit.

New connections are always forwarded normally. ``--events`` appends one line per accepted,
dropped and closed connection to a file. Bounded: at most ``MAX_CONNECTIONS`` connections,
and the process exits by itself after ``--lifetime`` seconds (default 300). Standard library
only; never listens on or connects to anything but 127.0.0.1 unless told to.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import struct
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
MAX_CONNECTIONS = 10_000
CHUNK = 64 * 1024
DIRECTIONS = ("c2s", "s2c")


def _byte_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    low, high = int(lo), int(hi or lo)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 1 <= LO <= HI, got {text!r}")
    return low, high


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n", 1)[0])
    p.add_argument("--target-port", type=int, required=True)
    p.add_argument("--listen-port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drop-prob", type=float, default=0.0)
    p.add_argument("--c2s-bytes", type=_byte_range, default=(1, 4096))
    p.add_argument("--s2c-bytes", type=_byte_range, default=(1, 256))
    p.add_argument("--max-drops", type=int, default=0)
    p.add_argument("--record-dir", type=Path, default=None)
    p.add_argument("--events", type=Path, default=None)
    p.add_argument("--lifetime", type=float, default=300.0)
    p.add_argument("--listen-host", default=HOST)
    p.add_argument("--target-host", default=HOST)
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--rate", type=float, default=0.0)
    return p


@dataclass
class Link:
    """One proxied connection: the client's socket, the server's, and what to do with them."""

    cid: int
    client_w: asyncio.StreamWriter
    server_w: asyncio.StreamWriter
    # Per direction: forward (True) or discard (False).
    forward: dict[str, bool] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, True))
    # The planned drop: (direction, bytes still to forward before it, reset?) or None.
    drop: tuple[str, int, bool] | None = None
    sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    closed: bool = False


class Proxy:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.links: dict[int, Link] = {}
        self.accepted = 0
        self.drops = 0
        self.bytes = dict.fromkeys(DIRECTIONS, 0)
        self.stop = asyncio.Event()
        self.latency_s = args.latency_ms / 1000.0
        self.rate = args.rate
        self.tasks: set[asyncio.Task[Any]] = set()
        if args.record_dir is not None:
            args.record_dir.mkdir(parents=True, exist_ok=True)

    # --- bookkeeping --------------------------------------------------------------------

    def event(self, line: str) -> None:
        if self.args.events is not None:
            with open(self.args.events, "a", encoding="utf-8") as f:
                f.write(line + "\n")

    def record(self, cid: int, direction: str, data: bytes) -> None:
        if self.args.record_dir is not None:
            with open(self.args.record_dir / f"conn{cid}.{direction}", "ab") as f:
                f.write(data)

    def stats(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted,
            "open": len(self.links),
            "drops": self.drops,
            "bytes": dict(self.bytes),
        }

    # --- connections --------------------------------------------------------------------

    def plan_drop(self) -> tuple[str, int, bool] | None:
        # Always draw the same numbers per connection, so a seed gives one plan sequence.
        hit = self.rng.random() < self.args.drop_prob
        direction = self.rng.choice(DIRECTIONS)
        low, high = self.args.c2s_bytes if direction == "c2s" else self.args.s2c_bytes
        budget = self.rng.randint(low, high)
        reset = self.rng.random() < 0.5
        return (direction, budget, reset) if hit else None

    async def handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        cid = self.accepted
        self.accepted += 1
        if cid >= MAX_CONNECTIONS:
            _abort(client_w, reset=True)
            return
        try:
            server_r, server_w = await asyncio.wait_for(
                asyncio.open_connection(self.args.target_host, self.args.target_port),
                timeout=10.0,
            )
        except (OSError, asyncio.TimeoutError):
            self.event(f"connect-failed {cid}")
            _abort(client_w, reset=True)
            return
        for w in (client_w, server_w):
            _nodelay(w)
            # drain() then waits until every byte is handed to the kernel.
            w.transport.set_write_buffer_limits(high=0)
        link = Link(cid, client_w, server_w, drop=self.plan_drop())
        self.links[cid] = link
        self.event(f"accept {cid} plan={link.drop}")
        try:
            await asyncio.gather(
                self.pump(link, "c2s", client_r, server_w),
                self.pump(link, "s2c", server_r, client_w),
            )
        finally:
            self.close_link(link, reset=False, why="end")

    async def pump(
        self,
        link: Link,
        direction: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        for _ in range(1 << 40):  # bounded by the connection's end and the proxy's lifetime
            if link.closed:
                return
            try:
                data = await reader.read(CHUNK)
            except (OSError, asyncio.IncompleteReadError):
                data = b""
            if link.closed:
                return
            if not data:
                # Pass the half-close on; the link ends when both directions have.
                with contextlib.suppress(OSError, RuntimeError):
                    if writer.can_write_eof():
                        writer.write_eof()
                return
            self.record(link.cid, direction, data)
            if not link.forward[direction]:
                continue  # stalled or blackholed: read and discard
            drop = link.drop
            cut: int | None = None
            if drop is not None and drop[0] == direction:
                if drop[1] <= len(data) and self.drops < self.args.max_drops:
                    cut = drop[1]
                    data = data[:cut]
                else:
                    link.drop = (drop[0], drop[1] - len(data), drop[2])
            if self.latency_s > 0:
                await asyncio.sleep(self.latency_s)
                if link.closed:
                    return
            try:
                writer.write(data)
                await writer.drain()
                if self.rate > 0:
                    await asyncio.sleep(len(data) / self.rate)
            except (OSError, RuntimeError):
                self.close_link(link, reset=True, why="write-failed")
                return
            link.sent[direction] += len(data)
            self.bytes[direction] += len(data)
            if cut is not None and drop is not None:
                self.drops += 1
                self.event(f"drop {link.cid} {direction} after={cut} reset={drop[2]}")
                self.close_link(link, reset=drop[2], why="drop")
                return

    def close_link(self, link: Link, *, reset: bool, why: str) -> None:
        if link.closed:
            return
        link.closed = True
        self.links.pop(link.cid, None)
        for w in (link.client_w, link.server_w):
            _abort(w, reset=reset)
        self.event(f"close {link.cid} {why} c2s={link.sent['c2s']} s2c={link.sent['s2c']}")

    # --- commands -----------------------------------------------------------------------

    def command(self, line: str) -> str:
        words = line.split()
        if not words:
            return "error empty command"
        links = list(self.links.values())
        if words == ["drop"]:
            for link in links:
                self.close_link(link, reset=True, why="command")
            return f"ok drop {len(links)}"
        if words == ["stall"]:
            for link in links:
                link.forward = dict.fromkeys(DIRECTIONS, False)
            return f"ok stall {len(links)}"
        if len(words) == 2 and words[0] == "blackhole" and words[1] in DIRECTIONS:
            for link in links:
                link.forward[words[1]] = False
            return f"ok blackhole {words[1]} {len(links)}"
        if words == ["resume"]:
            for link in links:
                link.forward = dict.fromkeys(DIRECTIONS, True)
            return f"ok resume {len(links)}"
        if len(words) == 2 and words[0] in ("latency", "rate"):
            try:
                value = float(words[1])
            except ValueError:
                return f"error not a number {words[1]!r}"
            if words[0] == "latency":
                self.latency_s = value / 1000.0
            else:
                self.rate = value
            return f"ok {words[0]} {words[1]}"
        if words == ["stats"]:
            return "stats " + json.dumps(self.stats(), sort_keys=True)
        if words == ["quit"]:
            self.stop.set()
            return "ok quit"
        return f"error unknown command {line.strip()!r}"

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        server = await asyncio.start_server(
            self.spawn, self.args.listen_host, self.args.listen_port, reuse_address=True
        )
        port = server.sockets[0].getsockname()[1]
        _say(f"port {port}")

        def on_line(line: str) -> None:
            if line == "":  # end of stdin
                self.stop.set()
                return
            _say(self.command(line))

        def read_stdin() -> None:
            for _ in range(1_000_000):
                line = sys.stdin.readline()
                loop.call_soon_threadsafe(on_line, line)
                if line == "":
                    return

        threading.Thread(target=read_stdin, daemon=True).start()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stop.wait(), timeout=self.args.lifetime)
        server.close()
        for link in list(self.links.values()):
            self.close_link(link, reset=True, why="exit")
        for task in list(self.tasks):
            task.cancel()

    def spawn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(self.handle(reader, writer))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _abort(writer: asyncio.StreamWriter, *, reset: bool) -> None:
    """Closes at once: a reset (RST) or a plain close (FIN), dropping anything unsent."""
    sock = writer.get_extra_info("socket")
    if reset and sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError, RuntimeError):
        writer.transport.abort()


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    asyncio.run(Proxy(args).run())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
