"""Issue #11, finding 4 (no bound on the bytes the TCP ingress holds): RSS growth while 100
peers, one after another (10 at a time), each connect, send 8 samples of 1 MiB, read its
acknowledgements (until 8, EOF or the timeout) and close,
and the learner never samples.

``Server({"x": f32[262144]}, batch_size=1, num_buffers=2, transport=TcpTransport(0,
host="127.0.0.1"[, max_buffered_bytes=B]))``. A peer gives up sending after ``--send-timeout``
(0.5 s) without progress (the ingress stopped reading at its bound) and closes anyway.
Reported: RSS after ``start()``, RSS when settled after the last peer, the growth, how many
peers could send all 8 samples, and ``stats().buffered_bytes`` / ``samples_inserted_total``.

Sides: "after" with the default bound (1 GiB), "after" with ``max_buffered_bytes=64 << 20``,
and "before" (no such argument), interleaved; each child bounded to 60 s.

Usage::

    python benches/tools/issue11_memory_bound.py [--rounds 1] [--json /tmp/issue11-bound.json]
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import threading
import time
from typing import Any

import _issue11 as c

PEERS = 100
CONCURRENT = 10
SAMPLES = 8
ELEMS = 1 << 18  # float32: 1 MiB per sample


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--send-timeout", type=float, default=0.5)
    ap.add_argument("--peers", type=int, default=PEERS, help="peers in all (default 100)")


def child(args: argparse.Namespace) -> dict[str, Any]:
    echo = c.import_echo()
    import numpy as np

    c.watchdog(55.0)
    bound = args.bound if args.bound else None
    example = {"x": np.zeros(ELEMS, np.float32)}
    payload = np.full(ELEMS, 3.0, np.float32).tobytes() * SAMPLES
    kw = {} if bound is None else {"max_buffered_bytes": bound}
    server = echo.Server(
        example, batch_size=1, num_buffers=2, transport=echo.TcpTransport(0, host=c.HOST, **kw)
    )
    server.start()
    port = server.port
    rss0 = c.settle_rss(max_s=2.0)
    full = [0]
    partial = [0]
    acks = [0]
    errors: list[str] = []
    lock = threading.Lock()
    t0 = time.monotonic()

    def peer() -> None:
        try:
            sock, _ = c.raw_peer(port)
        except Exception as e:  # noqa: BLE001 -- reported, not fatal
            with lock:
                errors.append(f"connect: {type(e).__name__}: {e}")
            return
        try:
            sock.settimeout(args.send_timeout)
            sock.sendall(payload)
            with lock:
                full[0] += 1
            # Read the acks before closing: closing with unread acks would reset the
            # connection and discard what the kernel has not delivered yet.
            sock.shutdown(socket.SHUT_WR)
            got = 0
            with contextlib.suppress(OSError):
                while got < SAMPLES:
                    chunk = sock.recv(SAMPLES - got)
                    if not chunk:
                        break
                    got += len(chunk)
            with lock:
                acks[0] += got
        except TimeoutError:
            with lock:
                partial[0] += 1
        except OSError as e:
            with lock:
                errors.append(f"send: {type(e).__name__}: {e}")
        finally:
            sock.close()

    for _ in range(-(-args.peers // CONCURRENT)):
        threads = [threading.Thread(target=peer, daemon=True) for _ in range(CONCURRENT)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15.0)
    t_peers = time.monotonic() - t0
    rss1 = c.settle_rss(max_s=6.0)
    st = server.stats()
    doc = {
        **c.echo_facts(echo),
        "max_buffered_bytes": bound,
        "rss_start_mib": round(rss0, 1),
        "rss_end_mib": round(rss1, 1),
        "growth_mib": round(rss1 - rss0, 1),
        "peers": args.peers,
        "peers_full": full[0],
        "peers_stalled": partial[0],
        "acks": acks[0],
        "errors": errors[:3],
        "n_errors": len(errors),
        "buffered_bytes_mib": (
            None
            if getattr(st, "buffered_bytes", None) is None
            else round(st.buffered_bytes / c.MIB, 1)
        ),
        "samples_inserted": st.samples_inserted_total,
        "peers_seconds": round(t_peers, 2),
    }
    server.close()
    return doc


def sides(args: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    return [
        ("after", args.after, ["--bound", "0"]),
        ("before", args.before, ["--bound", "0"]),
        ("after-64M", args.after, ["--bound", str(64 << 20)]),
    ]


def _add(ap: argparse.ArgumentParser) -> None:
    add_args(ap)
    ap.add_argument("--bound", type=int, default=None, help=argparse.SUPPRESS)


def report(results: list[dict[str, Any]]) -> None:
    n = results[0].get("peers", PEERS) if results else PEERS
    print(
        f"# finding 4: RSS growth (MiB), {n} peers x (connect, 8 x 1 MiB, read acks, close),"
        " learner not sampling"
    )
    print(
        f"{'side':10} {'round':>5} {'bound':>8} {'RSS0':>6} {'RSS1':>6} {'growth':>7}"
        f" {'buffered':>8} {'inserted':>8} {'acks':>5} {'full/stalled':>12} {'peers s':>7}"
        f" {'load1':>6}"
    )
    for d in results:
        if "error" in d or "growth_mib" not in d:
            print(f"{d['side']:10} error: {d.get('error')} {d.get('stderr_tail', '')[-300:]}")
            continue
        bound = d["max_buffered_bytes"]
        bound_s = "default" if bound is None else f"{bound >> 20}M"
        if d["side"] == "before":
            bound_s = "none"
        full_stalled = f"{d['peers_full']}/{d['peers_stalled']}"
        print(
            f"{d['side']:10} {d['round']:>5} {bound_s:>8} {d['rss_start_mib']:>6.0f}"
            f" {d['rss_end_mib']:>6.0f} {d['growth_mib']:>7.0f} {d['buffered_bytes_mib']!s:>8}"
            f" {d['samples_inserted']:>8} {d['acks']:>5} {full_stalled:>12}"
            f" {d['peers_seconds']:>7.1f} {d['load_start'][0]:>6.2f}"
        )
        if d["n_errors"]:
            print(f"   errors {d['n_errors']}: {d['errors']}")


if __name__ == "__main__":
    sys.exit(c.main("bound", child, report, add_args=_add, sides=sides, child_timeout=60.0))
