"""echo demo: rollout workers stream samples to a learner over TCP; the learner checks them all.

The learner starts a `Server` with a `TcpTransport` on a free loopback port, then launches
`--workers` worker processes. Each worker connects a `TcpClient` and sends `--samples`
samples (an Atari-sized observation, a reward and a (worker, sequence) id), then closes the
client (which flushes). On the learner's host the clients move samples through shared
memory (negotiated over the TCP connection); `--tcp` makes them use TCP for the samples
too. The learner consumes whole batches, checks that every sample arrived exactly once and
in per-worker order, and prints the throughput.

    bash scripts/demo.sh --workers 4 --samples 20000

It needs only echo and numpy: with tqdm installed (the bench extra) it shows a progress bar.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from contextlib import nullcontext

import numpy as np

try:
    from tqdm import tqdm
except ModuleNotFoundError:  # tqdm comes with the bench extra; without it, no progress bar
    tqdm = None

from echo import Server, TcpClient, TcpTransport


def example(obs_shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    return {
        "obs": np.zeros(obs_shape, np.uint8),
        "reward": np.zeros((), np.float32),
        "id": np.zeros((2,), np.int64),
    }


def worker(port: int, worker_id: int, samples: int, obs_shape: tuple[int, ...], tcp: bool) -> None:
    """One rollout worker: connect, send `samples` samples, close (flushes)."""
    client = TcpClient("127.0.0.1", port, example(obs_shape), shared_memory=False if tcp else None)
    obs = np.random.default_rng(worker_id).integers(0, 255, obs_shape, dtype=np.uint8)
    for seq in range(samples):
        client.send({"obs": obs, "reward": np.float32(seq), "id": np.array([worker_id, seq])})
    client.close()


def learner(args: argparse.Namespace) -> None:
    obs_shape = tuple(args.obs_shape)
    spec = example(obs_shape)
    transport = TcpTransport(port=0, host="127.0.0.1")
    server = Server(spec, batch_size=args.batch_size, transport=transport)
    server.start()
    assert server.port is not None
    sample_bytes = sum(leaf.nbytes for leaf in spec.values())
    total = args.workers * args.samples
    batches = total // args.batch_size
    print(
        f"echo demo: learner on 127.0.0.1:{server.port}, {args.workers} worker processes x "
        f"{args.samples} samples of {sample_bytes / 1024:.1f} KiB, batch {args.batch_size}"
    )
    worker_args = ["--port", str(server.port), "--samples", str(args.samples)]
    worker_args += ["--obs-shape", *map(str, obs_shape)] + (["--tcp"] if args.tcp else [])
    workers = [
        subprocess.Popen([sys.executable, __file__, "--worker", str(w), *worker_args])
        for w in range(args.workers)
    ]
    next_seq = np.zeros(args.workers, np.int64)
    start: float | None = None
    try:
        total_samples = batches * args.batch_size
        progress = (
            tqdm(total=total_samples, unit="samples", unit_scale=True) if tqdm else nullcontext()
        )
        with progress as bar:
            for _ in range(batches):
                sample = server.sample(timeout=120)
                assert sample is not None
                start = start or time.perf_counter()
                for worker_id, seq in sample.batch["id"]:
                    if seq != next_seq[worker_id]:
                        raise SystemExit(
                            f"worker {worker_id}: expected {next_seq[worker_id]}, got {seq}"
                        )
                    next_seq[worker_id] += 1
                if bar is not None:
                    bar.update(args.batch_size)
        elapsed = time.perf_counter() - (start or time.perf_counter())
        for proc in workers:
            proc.wait(timeout=60)
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
        server.close()
    on_shm = server.stats().shm_connections_total
    received = int(next_seq.sum())
    rate = (received - args.batch_size) / max(elapsed, 1e-9)
    print(
        f"received {received:,} samples exactly once, in per-worker order: "
        f"{rate:,.0f} samples/s, {rate * sample_bytes / 1e9:.2f} GB/s "
        f"(timed from the first batch); {on_shm} of {args.workers} workers on same-host "
        f"shared memory, the rest on TCP"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=20_000, help="samples per worker")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--obs-shape", type=int, nargs="+", default=[4, 84, 84])
    parser.add_argument("--tcp", action="store_true", help="samples over TCP, not shared memory")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.port, args.worker, args.samples, tuple(args.obs_shape), args.tcp)
    else:
        learner(args)


if __name__ == "__main__":
    main()
