"""The wire part of the ``compression`` suite (:mod:`benches.suites.compression`): samples/s
of ``TcpClient`` workers sending real Atari steps to a ``Server`` with ``compress=``, with and
without wire compression, directly and through a relay process on loopback that limits each
direction to a rate (a token bucket), and the relay's own ceiling (raw bytes/s of one
connection through it). The relay and the workers run in child processes
(``python -m benches.suites.compression_wire relay|worker ...``); every loop is bounded in
count and time, and the children it starts are the only processes it ends.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from benches import common as c
from benches.suites import compression_common as cc
from benches.suites.compression_common import BATCH, MAX_CALLS, example, pool

RELAY_CHUNK = 256 * 1024
BLAST_CHUNK = 1 << 20


def wire_cases(params: dict[str, Any]) -> list[str]:
    return ["direct", "relay-limited", "relay-unlimited"]


def wire_limit(params: dict[str, Any]) -> float:
    per_case = 90.0 + 2 * (float(params["wire_seconds"]) + float(params["wire_warmup"]))
    blasts = 4 * (float(params["wire_seconds"]) + 20.0)
    return 2 * len(wire_cases(params)) * per_case + blasts


# --------------------------------------------------------------------------- the relay


class Bucket:
    """A token bucket of ``rate`` bytes/s and a burst of ``burst`` bytes, shared by the
    threads of one direction of the link. A taker that overdraws waits until the debt would
    be paid, so the long-run rate is exact."""

    def __init__(self, rate: float, burst: int = RELAY_CHUNK) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.last = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
            self.tokens -= n
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


def _pump(
    src: socket.socket,
    dst: socket.socket,
    bucket: Bucket | None,
    stop: threading.Event,
    tally: list[int],
) -> None:
    """Forwards ``src`` to ``dst`` until EOF, an error or ``stop``; counts bytes in ``tally``."""
    buf = bytearray(RELAY_CHUNK)
    view = memoryview(buf)
    while not stop.is_set():
        try:
            n = src.recv_into(buf)
        except TimeoutError:
            continue
        except OSError:
            break
        if n == 0:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            break
        if bucket is not None:
            bucket.take(n)
        try:
            dst.sendall(view[:n])
        except OSError:
            break
        tally[0] += n
    stop.set()


def relay_main(target_port: int, rate_bytes: float, seconds: float) -> int:
    """A TCP relay on 127.0.0.1: says ``port N``, forwards every connection to
    ``target_port`` (rate-limited per direction when ``rate_bytes`` > 0) until stdin closes or
    ``seconds`` pass, then says ``bytes UP DOWN`` and exits."""
    c.watchdog(seconds + 30.0)
    listener = socket.create_server((c.HOST, 0), backlog=64)
    listener.settimeout(0.2)
    print(f"port {listener.getsockname()[1]}", flush=True)
    done = threading.Event()

    def stdin_closed() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=stdin_closed, daemon=True).start()
    up = Bucket(rate_bytes) if rate_bytes > 0 else None
    down = Bucket(rate_bytes) if rate_bytes > 0 else None
    tallies: list[list[int]] = []
    socks: list[socket.socket] = []
    threads: list[threading.Thread] = []
    deadline = time.monotonic() + seconds
    while not done.is_set() and time.monotonic() < deadline and len(socks) < 2000:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        try:
            server = socket.create_connection((c.HOST, target_port), timeout=10.0)
        except OSError:
            conn.close()
            continue
        for s in (conn, server):
            s.settimeout(0.5)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks += [conn, server]
        stop = threading.Event()
        for src, dst, bucket in ((conn, server, up), (server, conn, down)):
            tally = [0]
            tallies.append(tally)
            t = threading.Thread(target=_pump, args=(src, dst, bucket, stop, tally), daemon=True)
            t.start()
            threads.append(t)
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()
    for t in threads:
        t.join(timeout=2.0)
    listener.close()
    up_bytes, down_bytes = sum(t[0] for t in tallies[0::2]), sum(t[0] for t in tallies[1::2])
    print(f"bytes {up_bytes} {down_bytes}", flush=True)
    return 0


class Relay:
    """The relay process (this file), started here and ended here."""

    def __init__(self, target_port: int, rate_mbit: float, seconds: float) -> None:
        cmd = [sys.executable, "-m", "benches.suites.compression_wire", "relay", str(target_port)]
        cmd += [str(rate_mbit * 1e6 / 8), str(seconds)]
        self.proc = subprocess.Popen(
            cmd,
            cwd=c.ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if line[:1] != ["port"]:
            self.close()
            raise RuntimeError(f"the relay did not start: {line}")
        self.port = int(line[1])

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=15.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # by PID: the relay started here
            self.proc.wait(timeout=10.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _blast_through(relay_rate_mbit: float | None, seconds: float) -> float:
    """Raw bytes/s from a sender thread to a sink thread over loopback, through a relay at
    ``relay_rate_mbit`` (0: unlimited) or directly (None); counted at the sink, after a
    warm-up of a tenth of ``seconds``."""
    sink = socket.create_server((c.HOST, 0))
    sink.settimeout(10.0)
    relay = None
    port = sink.getsockname()[1]
    if relay_rate_mbit is not None:
        relay = Relay(port, relay_rate_mbit, seconds + 30.0)
        port = relay.port
    received = [0]  # bytes that arrived at the sink
    stop = threading.Event()

    def drain() -> None:
        conn, _ = sink.accept()
        conn.settimeout(0.5)
        buf = bytearray(BLAST_CHUNK)
        while not stop.is_set():
            try:
                n = conn.recv_into(buf)
            except TimeoutError:
                continue
            except OSError:
                break
            if n == 0:
                break
            received[0] += n
        conn.close()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    out = socket.create_connection((c.HOST, port), timeout=10.0)
    out.settimeout(5.0)
    chunk = memoryview(bytearray(os.urandom(BLAST_CHUNK)))
    t0 = time.monotonic()
    warm, end = t0 + seconds / 10, t0 + seconds + seconds / 10
    base, t_base = None, t0
    try:
        for _ in range(10**7):
            now = time.monotonic()
            if base is None and now >= warm:
                base, t_base = received[0], now
            if now >= end:
                break
            out.sendall(chunk)
    except OSError:
        pass
    got, t_end = received[0], time.monotonic()
    out.close()
    stop.set()
    reader.join(timeout=5.0)
    sink.close()
    if relay is not None:
        relay.close()
    return (got - (base or 0)) / max(1e-9, t_end - t_base)


# --------------------------------------------------------------------------- wire workers


def worker_main(spec: dict[str, Any]) -> int:
    """A ``TcpClient`` worker: connects, says ``ready``, waits for ``go END``, ``send()``s
    pool items until ``END`` (``time.monotonic()``), ``wait()``s, and says ``result {...}``."""
    import echo

    c.watchdog(float(spec["limit_s"]))
    params = spec["params"]
    obs = pool(params, "mixed", int(spec["pool_limit"]))
    singles = [cc.one_item(obs, i) for i in range(len(obs))]
    # `wire_compression=False` only where the keyword exists (the parent checked).
    kwargs: dict[str, Any] = {"max_inflight_msgs": 32, "shared_memory": False}
    kwargs.update(spec["client_kwargs"])
    report: dict[str, Any] = {"sent": 0, "error": None}
    try:
        client = echo.TcpClient(c.HOST, int(spec["port"]), example(), **kwargs)
    except Exception as e:  # noqa: BLE001 - reported to the learner
        print("ready", flush=True)
        print("result " + json.dumps({**report, "error": f"connect: {e}"}), flush=True)
        return 1
    print("ready", flush=True)
    line = sys.stdin.readline().split()
    if line[:1] != ["go"]:
        client.close(timeout=1.0)
        return 1
    end = float(line[1])
    j = int(spec["wid"]) * 997 % len(singles)
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    sent = 0
    try:
        for _ in range(MAX_CALLS):
            if time.monotonic() >= end:
                break
            client.send(singles[j], timeout=30.0)
            j = (j + 1) % len(singles)
            sent += 1
        client.wait(timeout=60.0)
        client.close(timeout=30.0)
    except Exception as e:  # noqa: BLE001 - reported to the learner
        report["error"] = f"{type(e).__name__}: {e}"
        client.close(timeout=1.0)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    report["sent"] = sent
    report["cpu_s"] = ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime
    print("result " + json.dumps(report), flush=True)
    return 0


def _wire_round(
    params: dict[str, Any], path: str, wire_compression: bool, pool_limit: int
) -> dict[str, Any]:
    """One measurement: a compressing server, maybe a relay, ``workers`` worker processes."""
    import echo

    k = int(params["workers"])
    seconds, warmup = float(params["wire_seconds"]), float(params["wire_warmup"])
    obs = pool(params, "mixed", pool_limit)
    server = echo.Server(
        example(),
        BATCH,
        sampler=echo.Uniform(),
        max_size=max(1000, 4 * BATCH),
        seed=4,
        compress={"obs": echo.Zstd(1)},
        transport=echo.TcpTransport(port=0, host=c.HOST, shared_memory=False),
    )
    server.start()
    relay = None
    procs: list[subprocess.Popen[str]] = []
    out: dict[str, Any] = {"path": path, "wire_compression": wire_compression, "workers": k}
    try:
        port = server.port
        if path != "direct":
            rate = float(params["rate_mbit"]) if path == "relay-limited" else 0.0
            relay = Relay(port, rate, 60.0 + seconds + warmup)
            port = relay.port
        limit = 60.0 + 2 * (seconds + warmup)
        spec = {"params": params, "port": port, "pool_limit": pool_limit, "limit_s": limit}
        spec["client_kwargs"] = {}
        if wire_compression_available() and not wire_compression:
            spec["client_kwargs"] = {"wire_compression": False}
        for wid in range(k):
            cmd = [sys.executable, "-m", "benches.suites.compression_wire", "worker"]
            cmd.append(json.dumps({**spec, "wid": wid}))
            procs.append(
                subprocess.Popen(
                    cmd, cwd=c.ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
                )
            )
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a worker did not start")
        now = time.monotonic()
        end = now + warmup + seconds
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(f"go {end}\n")
            p.stdin.flush()
        time.sleep(max(0.0, now + warmup - time.monotonic()))
        n0, t0 = server.stats().samples_inserted_total, time.monotonic()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(max(0.0, end - time.monotonic()))
        n1, t1 = server.stats().samples_inserted_total, time.monotonic()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        reports = []
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            reports.append(json.loads(line[len("result ") :]) if line.startswith("result ") else {})
        errors = [r.get("error") or "no result" for r in reports if r.get("error") or not r]
        if errors:
            raise RuntimeError("; ".join(errors))
        got = server.sample(timeout=10)
        out["samples_per_s"] = (n1 - n0) / (t1 - t0)
        item_bytes = sum(x.nbytes for x in cc.one_item(obs, 0).values())
        out["mb_per_s_raw"] = out["samples_per_s"] * item_bytes / 1e6
        out["sent"] = sum(r.get("sent", 0) for r in reports)
        out["received"] = server.stats().samples_inserted_total
        worker_cpu = sum(r.get("cpu_s", 0.0) for r in reports)
        out["worker_cpu_us"] = 1e6 * worker_cpu / max(1, out["sent"])
        learner_cpu = ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime
        out["learner_cpu_us"] = 1e6 * learner_cpu / max(1, n1 - n0)
        out["correct"] = (
            len(reports) == k
            and got is not None
            and cc.check_obs(got.batch["obs"], got.batch["action"], obs)
        )
    except Exception as e:  # noqa: BLE001 - reported in the record
        out["error"] = f"{type(e).__name__}: {e}"
        out["correct"] = False
    finally:
        for p in procs:
            if p.stdin is not None:
                with contextlib.suppress(OSError):
                    p.stdin.close()
            try:
                p.wait(timeout=30.0)
            except subprocess.TimeoutExpired:
                p.kill()  # by PID: the workers started here
                p.wait(timeout=10.0)
            if p.stdout is not None:
                p.stdout.close()
        if relay is not None:
            relay.close()
        server.close()
    return out


def wire_compression_available() -> bool:
    import echo

    return "wire_compression" in inspect.signature(echo.TcpClient).parameters


def wire_part(params: dict[str, Any]) -> dict[str, Any]:
    seconds = float(params["wire_seconds"])
    out: dict[str, Any] = {
        "with_available": wire_compression_available(),
        "rate_mbit": float(params["rate_mbit"]),
        "blast_mb_per_s": {
            "direct": _blast_through(None, seconds) / 1e6,
            "relay-unlimited": _blast_through(0.0, seconds) / 1e6,
            "relay-limited": _blast_through(float(params["rate_mbit"]), seconds) / 1e6,
        },
        "rounds": [],
    }
    pool_limit = min(1000, int(params["pool_steps"]))
    modes = [False, True] if out["with_available"] else [False]
    for i, path in enumerate(wire_cases(params)):
        for mode in modes if i % 2 == 0 else modes[::-1]:
            t0 = time.monotonic()
            r = _wire_round(params, path, mode, pool_limit)
            print(
                f"compression: wire {path} wire_compression={mode}: "
                f"{r.get('samples_per_s', float('nan')):,.0f}/s in {time.monotonic() - t0:.1f} s",
                file=sys.stderr,
                flush=True,
            )
            out["rounds"].append(r)
    out["correct"] = all(r.get("correct") for r in out["rounds"])
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["relay"] and len(argv) == 4:
        return relay_main(int(argv[1]), float(argv[2]), float(argv[3]))
    if argv[:1] == ["worker"] and len(argv) == 2:
        return worker_main(json.loads(argv[1]))
    print("usage: python -m benches.suites.compression_wire relay|worker ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
