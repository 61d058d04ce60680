"""echo demo: producers feed a learner through the ring; the learner checks every sample.

Several producer threads each submit `--samples` samples (an Atari-sized observation, a
reward, and a (producer, sequence) id); the learner consumes whole batches with
`dataset_iter()`, checks that every sample arrived exactly once and in per-producer order,
and prints the throughput.

    bash scripts/demo.sh --producers 4 --samples 50000
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
from tqdm import tqdm

from echo import Server, ServerClosedError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=50_000, help="samples per producer")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--obs-shape", type=int, nargs="+", default=[4, 84, 84])
    args = parser.parse_args()

    obs_shape = tuple(args.obs_shape)
    example = {
        "obs": np.zeros(obs_shape, np.uint8),
        "reward": np.zeros((), np.float32),
        "id": np.zeros((2,), np.int64),
    }
    total = args.producers * args.samples
    batches = total // args.batch_size
    server = Server(example, batch_size=args.batch_size)
    server.start()

    def produce(producer: int) -> None:
        obs = np.random.default_rng(producer).integers(0, 255, obs_shape, dtype=np.uint8)
        try:
            for seq in range(args.samples):
                server.submit(
                    {"obs": obs, "reward": np.float32(seq), "id": np.array([producer, seq])}
                )
        except ServerClosedError:
            return  # the learner took every full batch and closed; the remainder is dropped

    threads = [
        threading.Thread(target=produce, args=(p,), daemon=True) for p in range(args.producers)
    ]
    sample_bytes = sum(leaf.nbytes for leaf in example.values())
    print(
        f"echo demo: {args.producers} producers x {args.samples} samples of "
        f"{sample_bytes / 1024:.1f} KiB, batch {args.batch_size}"
    )
    next_seq = np.zeros(args.producers, np.int64)
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    with tqdm(total=batches * args.batch_size, unit="samples", unit_scale=True) as bar:
        for _ in range(batches):
            sample = server.sample(timeout=60)
            assert sample is not None
            ids = sample.batch["id"]
            for producer, seq in ids:
                if seq != next_seq[producer]:
                    raise SystemExit(
                        f"producer {producer}: expected {next_seq[producer]}, got {seq}"
                    )
                next_seq[producer] += 1
            bar.update(args.batch_size)
    elapsed = time.perf_counter() - start
    server.close()
    for thread in threads:
        thread.join(timeout=5)
    received = int(next_seq.sum())
    print(
        f"received {received:,} samples exactly once, in order, in {elapsed:.2f} s: "
        f"{received / elapsed:,.0f} samples/s, {received * sample_bytes / elapsed / 1e9:.2f} GB/s"
    )


if __name__ == "__main__":
    main()
