"""Checkpoint stall and throughput (issue #13): the worst and p99 latency of `submit()` and
`sample()` under a steady producer and consumer, without and with checkpoints running, and
the write / restore throughput of a checkpoint against a plain numpy `tofile` / `fromfile` of
the same bytes on the same disk.

The replay table (`--kind replay`, the default) is filled to `--items` items of `--bytes`
bytes first; each phase then runs for `--seconds` with one producer thread (`submit`) and one
consumer thread (`sample`), and in the second phase the main thread checkpoints back to back.
`--kind fifo` does the same with a FIFO ring of `--num-buffers` batches of 32 (the producer
keeps it near full: a checkpoint then copies a full ring and pins it chunk by chunk).

The issue's target, a 1e6-item ~1 GiB table: ``python
benches/tools/issue13_checkpoint_stall.py --items 1000000 --bytes 1024 --seconds 10``
(about 4 GiB of memory and 3 GiB of disk at the peak). Smaller: the defaults.

Throughput: the same bytes written with numpy `tofile` + fsync, and read back with
`fromfile`, in the same run and on the same disk. Dropping the page cache needs root (it is
not done): the restore and `fromfile` both read files just written, so both numbers are
page-cache reads, not disk reads; compare them with each other, not with the disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from typing import Any

import numpy as np

import echo


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--bytes", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--kind", choices=["replay", "fifo"], default="replay")
    parser.add_argument("--num-buffers", type=int, default=64, help="FIFO ring batches")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="echo-issue13-", dir=args.dir)
    fifo = args.kind == "fifo"
    try:
        example = {"x": np.zeros(args.bytes, np.uint8)}
        if fifo:
            server = echo.Server(example, 32, num_buffers=args.num_buffers)
            items = 32 * args.num_buffers
        else:
            server = echo.Server(example, 32, max_size=args.items, sampler=echo.Uniform(), seed=0)
            items = args.items
            # Fresh random bytes, like the `tofile` comparison's: a virtual disk that skips
            # zero blocks or deduplicates repeated ones must not favour either side.
            rng = np.random.default_rng(1)
            for start in range(0, args.items, 10_000):
                n = min(10_000, args.items - start)
                server.submit_batch({"x": rng.integers(0, 255, (n, args.bytes), np.uint8)})
        total = items * args.bytes
        mib = total / 2**20
        print(
            f"echo {echo.__version__} {args.kind}: {items} items x {args.bytes} B = {mib:.0f} MiB"
            f" ({os.cpu_count()} CPUs)"
        )
        for name, target in (("no checkpoint", None), ("checkpoints", os.path.join(root, "c"))):
            r = phase(server, args.seconds, target, fifo)
            print(
                f"{name:>14}: insert p99 {r['insert_p99_ms']:.3f} ms"
                f" max {r['insert_max_ms']:.3f} ms"
                f" | sample p99 {r['sample_p99_ms']:.3f} ms"
                f" max {r['sample_max_ms']:.3f} ms"
                f" | {r['inserts']} inserts {r['samples']} batches {r['checkpoints']} checkpoints"
                + (
                    f" (median {r['checkpoint_s']:.3f} s, max {r['checkpoint_max_s']:.3f} s)"
                    if target
                    else ""
                )
            )
        if fifo:  # the ring is what it is after the phases: fill it for the throughput part
            rng = np.random.default_rng(4)
            while server.stats().store_size < items - 32:
                server.submit({"x": rng.integers(0, 255, args.bytes, np.uint8)}, timeout=10)
            total = server.stats().store_size * args.bytes
            mib = total / 2**20
        path = os.path.join(root, "quiet")
        t = time.perf_counter()
        server.checkpoint(path)
        write_s = time.perf_counter() - t
        server.close()
        t = time.perf_counter()
        echo.Server.restore(path).close()
        restore_s = time.perf_counter() - t
        print(f"quiet checkpoint of {mib:.0f} MiB: {write_s:.3f} s, restore {restore_s:.3f} s")
        raw = os.path.join(root, "raw.bin")
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
        print(
            f"write: checkpoint {mib / write_s:.0f} MiB/s"
            f" vs tofile+fsync {mib / tofile_s:.0f} MiB/s"
            f" ({tofile_s / write_s:.0%}); restore {mib / restore_s:.0f} MiB/s"
            f" vs fromfile {mib / fromfile_s:.0f} MiB/s"
            f" ({fromfile_s / restore_s:.0%}; both from the page cache: dropping it needs root)"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
