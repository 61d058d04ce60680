"""Checkpoint stall and throughput: the worst and p99 latency of `submit()` and
`sample()` under a steady producer and consumer, without and with checkpoints running, and
the write / restore throughput of a checkpoint against a plain numpy `tofile` / `fromfile` of
the same bytes on the same disk.

The replay table (kind ``replay``) is filled to ``items`` items of ``bytes`` bytes first;
each phase then runs for ``seconds`` with one producer thread (``submit``) and one consumer
thread (``sample``), and in the second phase the main thread checkpoints back to back. Kind
``fifo`` does the same with a FIFO ring of ``num_buffers`` batches of 32 (the producer keeps
it near full: a checkpoint then copies a full ring and pins it chunk by chunk).

A 1e6-item ~1 GiB table: ``python -m benches checkpoint-stall --set items=1000000 --set
seconds=10`` (about 4 GiB of memory and 3 GiB of disk at the peak).

Throughput: the same bytes written with numpy `tofile` + fsync, and read back with
`fromfile`, in the same run and on the same disk. Dropping the page cache needs root (it is
not done): the restore and `fromfile` both read files just written, so both numbers are
page-cache reads, not disk reads; compare them with each other, not with the disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from typing import Any

import numpy as np

import echo
from benches import common as c


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def phase(
    server: echo.Server, seconds: float, checkpoint_to: str | None, fifo: bool
) -> dict[str, Any]:
    stop = threading.Event()
    inserts: list[float] = []
    samples: list[float] = []
    n_bytes = server._core.payload_size  # pyright: ignore[reportPrivateUsage]
    rng = np.random.default_rng(3)

    def producer() -> None:
        while not stop.is_set():
            row = {"x": rng.integers(0, 255, n_bytes, np.uint8)}
            t = time.perf_counter()
            try:
                server.submit(row, timeout=10)
            except TimeoutError:
                if fifo and stop.is_set():  # the consumer stopped first: the ring stays full
                    return
                raise
            inserts.append(time.perf_counter() - t)

    def consumer() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            server.sample(timeout=10)
            samples.append(time.perf_counter() - t)
            if fifo:  # a learner's step: the producer keeps the ring near full
                time.sleep(0.0005)

    threads = [threading.Thread(target=producer), threading.Thread(target=consumer)]
    for t in threads:
        t.start()
    checkpoints: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if checkpoint_to is None:
            stop.wait(min(0.05, max(0.0, end - time.perf_counter())))
            continue
        t = time.perf_counter()
        server.checkpoint(checkpoint_to)
        checkpoints.append(time.perf_counter() - t)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    return {
        "insert_p99_ms": 1e3 * percentile(inserts, 99),
        "insert_max_ms": 1e3 * max(inserts, default=float("nan")),
        "sample_p99_ms": 1e3 * percentile(samples, 99),
        "sample_max_ms": 1e3 * max(samples, default=float("nan")),
        "inserts": len(inserts),
        "samples": len(samples),
        "checkpoints": len(checkpoints),
        "checkpoint_s": float(np.median(checkpoints)) if checkpoints else float("nan"),
        "checkpoint_max_s": max(checkpoints, default=float("nan")),
    }


def parameters(quick: bool) -> dict[str, Any]:
    return {
        "kinds": ["replay", "fifo"],
        "items": 20_000 if quick else 100_000,
        "bytes": 1024,
        "seconds": 1.0 if quick else 3.0,
        "num_buffers": 64,
        "dir": tempfile.gettempdir(),
    }


def limit_s(params: dict[str, Any]) -> float:
    return len(params["kinds"]) * (2 * float(params["seconds"]) + 120.0) + 30.0


def _kind(kind: str, params: dict[str, Any], root: str) -> dict[str, Any]:
    fifo = kind == "fifo"
    n_bytes, seconds = int(params["bytes"]), float(params["seconds"])
    example = {"x": np.zeros(n_bytes, np.uint8)}
    if fifo:
        server = echo.Server(example, 32, num_buffers=int(params["num_buffers"]))
        items = 32 * int(params["num_buffers"])
    else:
        items = int(params["items"])
        server = echo.Server(example, 32, max_size=items, sampler=echo.Uniform(), seed=0)
        # Fresh random bytes, like the `tofile` comparison's: a virtual disk that skips
        # zero blocks or deduplicates repeated ones must not favour either side.
        rng = np.random.default_rng(1)
        for start in range(0, items, 10_000):
            n = min(10_000, items - start)
            server.submit_batch({"x": rng.integers(0, 255, (n, n_bytes), np.uint8)})
    quiet = phase(server, seconds, None, fifo)
    busy = phase(server, seconds, os.path.join(root, f"{kind}-c"), fifo)
    if fifo:  # the ring is what it is after the phases: fill it for the throughput part
        rng = np.random.default_rng(4)
        for _ in range(items):
            if server.stats().store_size >= items - 32:
                break
            server.submit({"x": rng.integers(0, 255, n_bytes, np.uint8)}, timeout=10)
        items = server.stats().store_size
    total = items * n_bytes
    path = os.path.join(root, f"{kind}-quiet")
    t = time.perf_counter()
    server.checkpoint(path)
    write_s = time.perf_counter() - t
    server.close()
    t = time.perf_counter()
    echo.Server.restore(path).close()
    restore_s = time.perf_counter() - t
    raw = os.path.join(root, f"{kind}-raw.bin")
    data = np.random.default_rng(0).integers(0, 255, total, np.uint8)
    t = time.perf_counter()
    with open(raw, "wb") as f:
        data.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    tofile_s = time.perf_counter() - t
    t = time.perf_counter()
    np.fromfile(raw, np.uint8)
    fromfile_s = time.perf_counter() - t
    mib = total / 2**20
    return {
        "kind": kind,
        "items": items,
        "mib": mib,
        "no_checkpoint": quiet,
        "checkpoints": busy,
        "write_mib_s": mib / write_s,
        "tofile_mib_s": mib / tofile_s,
        "restore_mib_s": mib / restore_s,
        "fromfile_mib_s": mib / fromfile_s,
    }


def measure(params: dict[str, Any]) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="echo-checkpoint-stall-", dir=params["dir"])
    try:
        return {"kinds": [_kind(kind, params, root) for kind in params["kinds"]]}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    columns = [
        "echo",
        "table",
        "checkpoints",
        "submit p99 / max ms",
        "sample p99 / max ms",
        "checkpoints taken (median s)",
    ]
    rows = c.failed_rows(results, len(columns))
    tp_columns = [
        "echo",
        "table",
        "MiB",
        "checkpoint write MiB/s",
        "tofile+fsync MiB/s",
        "restore MiB/s",
        "fromfile MiB/s",
    ]
    tp_rows = c.failed_rows(results, len(tp_columns))
    for side, r in results.items():
        for k in r.get("kinds", []):
            what = f"{k['kind']}, {k['items']:,} x {params['bytes']} B"
            for name in ("no_checkpoint", "checkpoints"):
                p = k[name]
                rows.append(
                    [
                        side,
                        what,
                        "running" if name == "checkpoints" else "none",
                        f"{c.num(p['insert_p99_ms'], '.2f')} / {c.num(p['insert_max_ms'], '.2f')}",
                        f"{c.num(p['sample_p99_ms'], '.2f')} / {c.num(p['sample_max_ms'], '.2f')}",
                        f"{p['checkpoints']} ({c.num(p['checkpoint_s'], '.3f')})"
                        if name == "checkpoints"
                        else "-",
                    ]
                )
            tp_rows.append(
                [
                    side,
                    k["kind"],
                    c.num(k["mib"], ".0f"),
                    c.num(k["write_mib_s"]),
                    c.num(k["tofile_mib_s"]),
                    c.num(k["restore_mib_s"]),
                    c.num(k["fromfile_mib_s"]),
                ]
            )
    return [
        {
            "title": f"Latency with and without checkpoints running, {params['seconds']:g} s "
            "per phase, one producer and one consumer thread",
            "columns": columns,
            "rows": rows,
        },
        {
            "title": "Checkpoint throughput against numpy tofile / fromfile of the same bytes",
            "columns": tp_columns,
            "rows": tp_rows,
            "notes": [
                "Restore and fromfile both read files just written: page-cache reads, not disk "
                "reads (dropping the cache needs root); compare them with each other."
            ],
        },
    ]
