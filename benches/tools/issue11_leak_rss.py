"""Issue #11, finding 3 (connections a blocked drainer never adopted leaked at shutdown): RSS
over three server lifetimes.

Each lifetime: ``Server({"x": f32[262144]}, batch_size=1, num_buffers=2,
transport=TcpTransport(0, host="127.0.0.1"))`` (1 MiB samples, a ring of two), ``start()``;
60 raw-socket peers (wire v1, one thread each) connect and each send 8 samples while the
learner never samples, so the drainers block on the full ring and the samples wait in the
ingress; when RSS has settled, ``close()``, ``del server``, ``gc.collect()``, then the peers
close their sockets. ``VmRSS`` after each lifetime, and again after glibc ``malloc_trim(0)``
(what stays after it is held, not merely cached by the allocator).

Run under "after" and "before", interleaved (``--rounds``); each child is bounded (60 s).

Usage::

    python benches/tools/issue11_leak_rss.py [--rounds 1] [--json /tmp/issue11-leak.json]
"""

from __future__ import annotations

import argparse
import gc
import sys
import threading
import time
from typing import Any

import _issue11 as c

LIFETIMES = 3
PEERS = 60
SAMPLES = 8
ELEMS = 1 << 18  # float32: 1 MiB per sample


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--lifetimes", type=int, default=LIFETIMES, help="server lifetimes (3)")


def lifetime(echo: Any, example: Any, payload: bytes, life: int) -> dict[str, Any]:
    """One server lifetime: start, 60 peers queue 8 MiB each, close, free; RSS after it."""
    t0 = time.monotonic()
    server = echo.Server(
        example,
        batch_size=1,
        num_buffers=2,
        transport=echo.TcpTransport(0, host=c.HOST),
    )
    server.start()
    port = server.port
    socks: list[Any] = []
    sent = [0]
    errors: list[str] = []
    lock = threading.Lock()

    def peer() -> None:
        try:
            sock, size = c.raw_peer(port)
            assert size == len(payload) // SAMPLES, size
            with lock:
                socks.append(sock)
            sock.settimeout(15.0)
            sock.sendall(payload)
            with lock:
                sent[0] += 1
        except Exception as e:  # noqa: BLE001 -- reported, not fatal
            with lock:
                errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=peer, daemon=True) for _ in range(PEERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20.0)
    loaded = c.settle_rss(max_s=8.0)
    st = server.stats()
    buffered = getattr(st, "buffered_bytes", None)
    inserted = st.samples_inserted_total
    server.close()
    del server, st
    gc.collect()
    with lock:
        for s in socks:
            s.close()
    gc.collect()
    time.sleep(0.3)
    after_close = c.settle_rss(max_s=3.0)
    c.malloc_trim()
    after_trim = c.rss_mib()
    time.sleep(1.0)  # anything freed late (threads still winding down)?
    c.malloc_trim()
    late = c.rss_mib()
    return {
        "lifetime": life + 1,
        "peers_done": sent[0],
        "errors": errors[:3],
        "n_errors": len(errors),
        "rss_loaded_mib": round(loaded, 1),
        "buffered_bytes_mib": None if buffered is None else round(buffered / c.MIB, 1),
        "samples_inserted": inserted,
        "rss_after_mib": round(after_close, 1),
        "rss_after_trim_mib": round(after_trim, 1),
        "rss_late_trim_mib": round(late, 1),
        "seconds": round(time.monotonic() - t0, 2),
    }


def child(args: argparse.Namespace) -> dict[str, Any]:
    echo = c.import_echo()
    import numpy as np

    watchdog = c.watchdog(55.0)
    example = {"x": np.zeros(ELEMS, np.float32)}
    payload = np.full(ELEMS, 7.0, np.float32).tobytes() * SAMPLES  # 8 MiB per peer
    rss0 = c.rss_mib()
    lifetimes = []
    for life in range(args.lifetimes):
        lifetimes.append(lifetime(echo, example, payload, life))
        print(f"lifetime {life + 1}: {lifetimes[-1]}", file=sys.stderr, flush=True)
    watchdog.cancel()
    return {**c.echo_facts(echo), "rss_start_mib": round(rss0, 1), "lifetimes": lifetimes}


def report(results: list[dict[str, Any]]) -> None:
    n = max((len(d.get("lifetimes", [])) for d in results), default=LIFETIMES)
    print(
        "# finding 3: VmRSS (MiB) after each server lifetime (60 peers x 8 x 1 MiB queued);"
        " (trim): after malloc_trim(0)"
    )
    print(
        f"{'side':8} {'round':>5} {'start':>7} "
        + " ".join(
            f"{'L' + str(i + 1) + ' loaded':>10} {'L' + str(i + 1) + ' after':>9} {'(trim)':>7}"
            for i in range(n)
        )
        + f" {'growth/L':>9} {'load1':>6}"
    )
    for d in results:
        if "error" in d or "lifetimes" not in d:
            print(f"{d['side']:8} error: {d.get('error')} {d.get('stderr_tail', '')[-300:]}")
            continue
        ls = d["lifetimes"]
        cells = " ".join(
            f"{x['rss_loaded_mib']:>10.0f} {x['rss_after_mib']:>9.0f}"
            f" {x['rss_after_trim_mib']:>7.0f}"
            for x in ls
        )
        growth = (ls[-1]["rss_after_trim_mib"] - d["rss_start_mib"]) / len(ls)
        print(
            f"{d['side']:8} {d['round']:>5} {d['rss_start_mib']:>7.0f} {cells} {growth:>9.0f}"
            f" {d['load_start'][0]:>6.2f}"
        )
        for x in ls:
            if x["n_errors"] or x["peers_done"] != PEERS:
                print(
                    f"   L{x['lifetime']}: peers done {x['peers_done']}/{PEERS},"
                    f" errors {x['n_errors']} {x['errors']}"
                )
        print("   1 s later, trimmed: " + ", ".join(str(x["rss_late_trim_mib"]) for x in ls))
        print(
            "   buffered_bytes MiB at load: "
            + ", ".join(str(x["buffered_bytes_mib"]) for x in ls)
            + "; inserted: "
            + ", ".join(str(x["samples_inserted"]) for x in ls)
        )


if __name__ == "__main__":
    sys.exit(c.main("leak", child, report, add_args=add_args, default_rounds=1, child_timeout=60.0))
