"""Load test: 1,000 concurrent TCP connections from one asyncio process to one echo learner.

The script starts a learner in a separate process (the same interpreter running this file
with ``--learner``): ``Server(example, batch_size, transport=TcpTransport(0, ...))``,
``start()``, then ``sample()`` continuously, recording every sample's id. This process is
the load generator and does not import echo: it speaks wire protocol v1 itself with asyncio
streams (read the handshake ``b"ECHO"``, version 1, ``u32`` LE array count, per array ``u32``
dtype size, ``u32`` ndim, ``ndim`` ``u32`` dims; then write raw ``payload_size``-byte samples
and read one ``0x01`` ack byte per sample), so the clients cost as little CPU as possible.

Example pytree: ``{"a_id": i64[2], "obs": f32[60]}`` (256 B on the wire; optree orders dict
keys, so ``a_id`` is the first 16 bytes: connection number, sequence number). Every ``obs``
byte is ``connection % 251`` so a torn or misaligned sample is caught.

1. Opens ``--connections`` (1,000) connections, at most ``--connect-concurrency`` handshakes
   at a time, and waits until all of them are open (they stay open until every connection
   has finished, so the learner holds them all at once).
2. Each connection sends ``--samples`` (200) samples with unique ids, at most ``--window``
   (32) unacknowledged, then waits for all of its acks.
3. The learner, told the total up front, ``submit()``s ``(-total) % batch_size`` marker
   samples (id -1) at start-up so the last batch completes, samples until it has seen
   everything (or its timeout), and reports: samples received, duplicates, ids missing,
   out-of-order ids, payload errors, its RSS (``VmRSS`` from ``/proc/self/status``: idle after
   ``start()``, peak while sampling, and ``VmHWM``), and the most ``active_connections`` any
   ``SampleInfo`` showed.

Reported: samples/s (client side: start signal to the last ack; learner side: first to last
batch), learner RSS in MB and per connection, ``lost == duplicated == 0``. The soft
``RLIMIT_NOFILE`` is raised (to the hard limit at most) in both processes when needed.
Bounded: the learner closes its server after ``--timeout`` (120 s) and the driver gives up and
ends the learner process it started after ``--timeout`` + 15 s. Loopback only.

Usage::

    .venv/bin/python benches/tools/load_1000.py --json benches/results/load-ours.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benches import common as h

HOST = "127.0.0.1"
MAGIC = b"ECHO"
ACK = 0x01
OBS_LEN = 60  # float32 elements of the "obs" leaf
ID_FMT = struct.Struct("<qq")


_log = h.logger("load_1000")


def _raise_nofile(needed: int) -> dict[str, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = soft
    if soft != resource.RLIM_INFINITY and soft < needed:
        new = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    return {"soft_before": int(before), "soft": int(soft), "hard": int(hard)}


def _rss_mb() -> dict[str, float]:
    """This process's ``VmRSS`` and ``VmHWM`` in MiB."""
    return {k: kib / 1024.0 for k, kib in h.proc_kib("/proc/self/status", "VmRSS", "VmHWM").items()}


# --------------------------------------------------------------------------- learner process


def learner_main(args: argparse.Namespace) -> int:
    import numpy as np

    import echo
    from echo import Server, TcpTransport

    limits = _raise_nofile(args.connections + 256)
    h.start_watchdog(args.timeout, "load_1000: learner", status=3)  # last resort
    bs = args.batch_size
    expected = args.connections * args.samples
    pad = (-expected) % bs
    example = {"a_id": np.zeros(2, np.int64), "obs": np.zeros(OBS_LEN, np.float32)}
    try:  # our TcpTransport: loopback only and room for every connection
        tr: Any = TcpTransport(0, host=HOST, max_connections=args.connections + 64)
    except TypeError:  # id-echo 0.2.1: TcpTransport(port, num_threads=8) only
        tr = TcpTransport(0)
    server = Server(example, batch_size=bs, transport=tr)
    server.start()
    marker = {"a_id": np.array([-1, -1], np.int64), "obs": np.zeros(OBS_LEN, np.float32)}
    for _ in range(pad):
        server.submit(marker)
    rss_idle = _rss_mb()
    print(json.dumps({"port": server.port, "rss_idle": rss_idle}), flush=True)

    n_total = expected + pad
    ids = np.full((n_total, 2), -2, np.int64)
    received = 0
    payload_bad = 0
    max_active = 0
    peak = {"rss": rss_idle.get("VmRSS", 0.0)}
    done = threading.Event()

    def monitor() -> None:
        last_print = time.monotonic()
        while not done.wait(0.1):
            rss = _rss_mb().get("VmRSS", 0.0)
            peak["rss"] = max(peak["rss"], rss)
            if time.monotonic() - last_print >= 1.0:
                last_print = time.monotonic()
                _log(
                    f"learner: {received:,}/{n_total:,} received, RSS {rss:.1f} MB,"
                    f" active connections {max_active}"
                )

    mon = threading.Thread(target=monitor, name="rss-monitor", daemon=True)
    mon.start()
    guard = h.call_later(args.timeout - 5.0, server.close)
    t_first = t_last = 0.0
    closed_early = False
    try:
        for _ in range(n_total // bs):
            smp = server.sample()
            now = time.monotonic()
            if smp is None:
                closed_early = True
                break
            if received == 0:
                t_first = now
            t_last = now
            a_id = smp.batch["a_id"]
            ids[received : received + bs] = a_id
            conn = a_id[:, 0]
            expect = np.where(conn >= 0, conn % 251, 0).astype(np.uint8)
            obs = smp.batch["obs"].view(np.uint8)
            payload_bad += int((obs != expect[:, None]).any(axis=1).sum())
            max_active = max(max_active, int(getattr(smp.info, "active_connections", 0)))
            received += bs
            smp = None
    finally:
        guard.cancel()
        done.set()
        server.close()
    mon.join(timeout=2.0)

    got = ids[:received]
    markers = int((got[:, 0] == -1).sum())
    real = got[got[:, 0] >= 0]
    conn, seq = real[:, 0], real[:, 1]
    ok = (conn < args.connections) & (seq >= 0) & (seq < args.samples)
    flat = conn[ok] * args.samples + seq[ok]
    seen = np.bincount(flat, minlength=expected)
    order = np.argsort(conn, kind="stable")
    same = conn[order][1:] == conn[order][:-1]
    out_of_order = int((np.diff(seq[order])[same] <= 0).sum())
    result = {
        "echo_version": getattr(echo, "__version__", None),
        "echo_path": echo.__file__,
        "echo_build": h.echo_build(echo),
        "nofile": limits,
        "expected": expected,
        "markers_expected": pad,
        "markers_received": markers,
        "received": int(real.shape[0]),
        "bad_ids": int((~ok).sum()),
        "duplicates": int((seen[seen > 1] - 1).sum()),
        "missing": int((seen == 0).sum()),
        "out_of_order": out_of_order,
        "payload_bad": payload_bad,
        "closed_early": closed_early,
        "max_active_connections": max_active,
        "learner_seconds": t_last - t_first,
        "learner_samples_per_s": (received - bs) / (t_last - t_first) if t_last > t_first else 0,
        "rss_idle_mb": rss_idle.get("VmRSS"),
        "rss_peak_mb": peak["rss"],
        "rss_hwm_mb": _rss_mb().get("VmHWM"),
        "cpu_s": time.process_time(),
    }
    print(json.dumps({"result": result}), flush=True)
    return 0


# --------------------------------------------------------------------------- load generator


@dataclass
class _Load:
    connections: int
    connected: int = 0
    finished: int = 0
    sent: int = 0
    acked: int = 0
    errors: list[str] = field(default_factory=lambda: [])
    all_connected: asyncio.Event = field(default_factory=asyncio.Event)
    go: asyncio.Event = field(default_factory=asyncio.Event)
    all_finished: asyncio.Event = field(default_factory=asyncio.Event)
    t_last_ack: float = 0.0


async def _read_handshake(reader: asyncio.StreamReader) -> tuple[int, list[tuple[int, ...]]]:
    """Reads a v1 handshake; returns (payload_size, shapes)."""
    head = await reader.readexactly(9)
    if head[:4] != MAGIC or head[4] != 1:
        raise ValueError(f"not an echo v1 handshake: {head!r}")
    (n_arrays,) = struct.unpack("<I", head[5:9])
    payload = 0
    shapes: list[tuple[int, ...]] = []
    for _ in range(n_arrays):
        dtype_size, ndim = struct.unpack("<II", await reader.readexactly(8))
        dims = struct.unpack(f"<{ndim}I", await reader.readexactly(4 * ndim)) if ndim else ()
        n = dtype_size
        for d in dims:
            n *= d
        payload += n
        shapes.append(tuple(dims))
    return payload, shapes


async def _connection(
    i: int, port: int, args: argparse.Namespace, load: _Load, sem: asyncio.Semaphore
) -> None:
    writer: asyncio.StreamWriter | None = None
    try:
        async with sem:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 30.0)
            payload_size, shapes = await asyncio.wait_for(_read_handshake(reader), 30.0)
        if shapes != [(2,), (OBS_LEN,)] or payload_size != 16 + 4 * OBS_LEN:
            raise ValueError(f"unexpected server layout {shapes}, {payload_size} B")
        load.connected += 1
        if load.connected == load.connections:
            load.all_connected.set()
        await load.go.wait()
        tail = bytes([i % 251]) * (4 * OBS_LEN)
        m, window = args.samples, args.window
        sent = acked = 0
        pack = ID_FMT.pack
        while acked < m:
            while sent < m and sent - acked < window:
                writer.write(pack(i, sent) + tail)
                sent += 1
            await writer.drain()
            data = await reader.read(4096)
            if not data:
                raise ConnectionError(f"server closed the connection after {acked} acks")
            if data.count(ACK) != len(data):
                raise ValueError(f"bad ack bytes {data[:16]!r}")
            acked += len(data)
        load.sent += sent
        load.acked += acked
        load.t_last_ack = time.monotonic()
    except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
        load.errors.append(f"conn {i}: {type(e).__name__}: {e}")
        if (
            not load.all_connected.is_set()
            and load.connected + len(load.errors) >= load.connections
        ):
            load.all_connected.set()
    finally:
        load.finished += 1
        if load.finished == load.connections:
            load.all_finished.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(load.all_finished.wait(), args.timeout)
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), 5.0)


async def _drive(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--learner",
        f"--connections={args.connections}",
        f"--samples={args.samples}",
        f"--batch-size={args.batch_size}",
        f"--timeout={args.timeout}",
    ]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        first = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60.0))
        port = int(first["port"])
        _log(f"learner pid {proc.pid} on port {port}, RSS idle {first['rss_idle']}")
        load = _Load(args.connections)
        sem = asyncio.Semaphore(args.connect_concurrency)
        t_c = time.monotonic()
        tasks = [
            asyncio.create_task(_connection(i, port, args, load, sem))
            for i in range(args.connections)
        ]
        await asyncio.wait_for(load.all_connected.wait(), args.timeout)
        connect_s = time.monotonic() - t_c
        _log(f"{load.connected} connections open in {connect_s:.2f} s ({len(load.errors)} errors)")
        t0 = time.monotonic()
        load.go.set()
        await asyncio.wait_for(asyncio.gather(*tasks), args.timeout)
        client_s = (load.t_last_ack or time.monotonic()) - t0
        _log(f"all connections done: {load.acked:,} acks in {client_s:.2f} s")
        line = await asyncio.wait_for(proc.stdout.readline(), 30.0)
        learner = json.loads(line)["result"] if line else {"error": "no result from learner"}
        await asyncio.wait_for(proc.wait(), 15.0)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return {
        "connect_s": connect_s,
        "connected": load.connected,
        "client_errors": load.errors[:20],
        "client_error_count": len(load.errors),
        "sent": load.sent,
        "acked": load.acked,
        "client_seconds": client_s,
        "samples_per_s": load.acked / client_s if client_s > 0 else 0.0,
        "learner": learner,
        "learner_returncode": proc.returncode,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n", 1)[0])
    p.add_argument("--learner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument("--samples", type=int, default=200, help="samples per connection")
    p.add_argument("--window", type=int, default=32, help="unacknowledged samples allowed")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--connect-concurrency", type=int, default=100)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--label", default="ours")
    args = p.parse_args(argv)
    if not (1 <= args.connections <= 20_000 and 1 <= args.samples <= 1_000_000):
        p.error("--connections in [1, 20000], --samples in [1, 1e6]")
    if args.learner:
        return learner_main(args)

    limits = _raise_nofile(args.connections + 256)
    _log(f"RLIMIT_NOFILE {limits}; {args.connections} connections x {args.samples} samples")
    load_before = h.loadavg()
    try:
        res = asyncio.run(asyncio.wait_for(_drive(args), args.timeout + 15.0))
    except asyncio.TimeoutError:
        _log(f"gave up after {args.timeout + 15.0:.0f} s")
        return 2
    lr = res["learner"]
    expected = args.connections * args.samples
    correct = (
        res["client_error_count"] == 0
        and res["acked"] == expected
        and lr.get("received") == expected
        and lr.get("duplicates") == 0
        and lr.get("missing") == 0
        and lr.get("bad_ids") == 0
        and lr.get("payload_bad") == 0
        and lr.get("markers_received") == lr.get("markers_expected")
        and not lr.get("closed_early", True)
    )
    rss_idle = lr.get("rss_idle_mb") or 0.0
    rss_peak = max(lr.get("rss_peak_mb") or 0.0, lr.get("rss_hwm_mb") or 0.0)
    print(f"# load_1000 ({args.label}): echo {lr.get('echo_version')} from {lr.get('echo_path')}")
    print(
        f"connections {res['connected']:,} (open in {res['connect_s']:.2f} s, max active seen by"
        f" the learner {lr.get('max_active_connections')}), {args.samples} samples each, "
        f"window {args.window}, batch {args.batch_size}"
    )
    print(
        f"samples/s: {res['samples_per_s']:,.0f} (client: {res['acked']:,} acks in "
        f"{res['client_seconds']:.2f} s), learner {lr.get('learner_samples_per_s', 0):,.0f}"
    )
    hwm = lr.get("rss_hwm_mb") or 0.0
    per_conn_kib = (rss_peak - rss_idle) * 1024 / args.connections
    print(
        f"learner RSS: idle {rss_idle:.1f} MB, peak {rss_peak:.1f} MB (sampled "
        f"{lr.get('rss_peak_mb') or 0:.1f}, VmHWM {hwm:.1f}), {per_conn_kib:.1f} KiB per "
        f"connection; learner CPU {lr.get('cpu_s', 0):.2f} s"
    )
    print(
        f"received {lr.get('received')}/{expected}, lost {lr.get('missing')}, duplicated "
        f"{lr.get('duplicates')}, out of order {lr.get('out_of_order')}, payload errors "
        f"{lr.get('payload_bad')}, client errors {res['client_error_count']}: correct {correct}"
    )
    if args.json is not None:
        doc = {
            **h.run_facts(args.label),
            "loadavg_before": load_before,
            "loadavg_after": h.loadavg(),
            "connections": args.connections,
            "samples_per_connection": args.samples,
            "window": args.window,
            "batch_size": args.batch_size,
            "correct": correct,
            **res,
        }
        h.write_json(args.json, doc)
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
