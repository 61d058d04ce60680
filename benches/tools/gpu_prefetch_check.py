"""Measures ``dataset_iter(device="cuda:0", prefetch=N)`` on a machine with an NVIDIA GPU:
pinned against pageable host-to-device bandwidth, and how much of the copy the prefetch
thread hides behind a training step.

NOT RUN YET: written on a machine without a GPU (and without PyTorch, which CI does not
install); run it where both are, from the repository root, with echo built or installed::

    python benches/tools/gpu_prefetch_check.py --json out.json

It needs numpy, echo and PyTorch with CUDA. All of it is bounded (``--steps`` batches per
measurement, every wait with a timeout):

1. Stops with exit status 2 ("no CUDA") where ``torch.cuda.is_available()`` is false.
2. H2D bandwidth: for ``pin_host_memory=True`` and ``False``, one batch (``--leaves`` leaves
   of ``--leaf-kb`` KiB per sample, ``--batch-size`` samples) copied leaf by leaf with
   ``tensor.to(device, non_blocking=True)`` from writable ring views, ``--reps`` times, then
   ``torch.cuda.synchronize()``: GB/s.
3. Overlap: a producer thread feeds ``--steps`` batches with ``submit_batch`` (each row's
   first float is its id); a training step is a chain of matmuls on the GPU sized to take
   about as long as one batch copy. Per step, the time of
   (a) the serial loop: ``dataset_iter(writable=True)``, a synchronous copy, the step,
       ``synchronize()``;
   (b) the prefetch loop: ``dataset_iter(device=..., prefetch=2)``, the step,
       ``synchronize()``.
   ``hidden = (serial - prefetch) / min(copy, step)``: the share of the copy (or step)
   that overlapped; 1.0 is perfect overlap. Both loops must see every id once and in order.
4. Prints a table and, with ``--json PATH``, writes every number.

Exit status: 0 when the checks passed, 1 when one failed, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

import numpy as np

import echo

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_NO_CUDA = 2
TIMEOUT_S = 30.0


def example(leaves: int, floats: int) -> dict[str, np.ndarray]:
    return {f"leaf{i:02d}": np.zeros((floats,), np.float32) for i in range(leaves)}


def rows(ids: np.ndarray, leaves: int, floats: int) -> dict[str, np.ndarray]:
    block = np.zeros((len(ids), floats), np.float32)
    block[:, 0] = ids
    return {f"leaf{i:02d}": block for i in range(leaves)}


def produce(server: echo.Server, steps: int, batch: int, leaves: int, floats: int) -> None:
    for step in range(steps):
        ids = np.arange(step * batch, (step + 1) * batch, dtype=np.float32)
        server.submit_batch(rows(ids, leaves, floats), timeout=TIMEOUT_S)
    server.close(drain=True)


def bandwidth(args: argparse.Namespace, torch: Any, pinned: bool) -> float:
    floats = args.leaf_kb * 256
    server = echo.Server(
        example(args.leaves, floats), args.batch_size, num_buffers=2, pin_host_memory=pinned
    )
    ids = np.arange(args.batch_size, dtype=np.float32)
    server.submit_batch(rows(ids, args.leaves, floats), timeout=TIMEOUT_S)
    sample = server.sample(timeout=TIMEOUT_S, writable=True)
    assert sample is not None
    host = [torch.from_numpy(leaf) for leaf in sample.batch.values()]
    nbytes = sum(t.numel() * t.element_size() for t in host)
    for _ in range(2):  # warm-up
        [t.to(args.device, non_blocking=True) for t in host]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.reps):
        [t.to(args.device, non_blocking=True) for t in host]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    server.close()
    return nbytes * args.reps / seconds / 1e9


def make_step(torch: Any, device: str, target_s: float) -> Any:
    """A GPU step (a chain of matmuls) that takes about `target_s` seconds."""
    x = torch.randn(2048, 2048, device=device)

    def run(n: int) -> Any:
        y = x
        for _ in range(n):
            y = y @ x
            y = y / y.norm()
        return y

    run(4)
    torch.cuda.synchronize()
    start = time.perf_counter()
    run(20)
    torch.cuda.synchronize()
    per = (time.perf_counter() - start) / 20
    n = max(1, round(target_s / per))
    return lambda: run(n)


def overlap(args: argparse.Namespace, torch: Any, copy_s: float) -> dict[str, float]:
    floats = args.leaf_kb * 256
    step = make_step(torch, args.device, copy_s)
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    step_s = time.perf_counter() - start

    def run(prefetch: bool) -> float:
        server = echo.Server(
            example(args.leaves, floats), args.batch_size, num_buffers=4, pin_host_memory=True
        )
        producer = threading.Thread(
            target=produce,
            args=(server, args.steps, args.batch_size, args.leaves, floats),
            daemon=True,
        )
        producer.start()
        seen: list[float] = []
        start = time.perf_counter()
        if prefetch:
            batches = server.dataset_iter(device=args.device, prefetch=2, timeout=TIMEOUT_S)
            for sample in batches:
                step()
                seen += sample.batch["leaf00"][:, 0].tolist()
                torch.cuda.synchronize()
        else:
            for sample in server.dataset_iter(writable=True, timeout=TIMEOUT_S):
                batch = {k: torch.from_numpy(v).to(args.device) for k, v in sample.batch.items()}
                step()
                seen += batch["leaf00"][:, 0].tolist()
                torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.steps
        producer.join(TIMEOUT_S)
        expected = [float(i) for i in range(args.steps * args.batch_size)]
        if seen != expected:
            raise AssertionError(f"prefetch={prefetch}: batches lost, repeated or out of order")
        return seconds

    serial_s = run(prefetch=False)
    prefetch_s = run(prefetch=True)
    hidden = (serial_s - prefetch_s) / min(copy_s, step_s)
    return {
        "copy_ms": copy_s * 1e3,
        "step_ms": step_s * 1e3,
        "serial_ms_per_step": serial_s * 1e3,
        "prefetch_ms_per_step": prefetch_s * 1e3,
        "hidden_fraction": hidden,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--leaves", type=int, default=8)
    parser.add_argument("--leaf-kb", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("no PyTorch: this check needs torch with CUDA", file=sys.stderr)
        return EXIT_NO_CUDA
    if not torch.cuda.is_available():
        print("no CUDA GPU visible to torch", file=sys.stderr)
        return EXIT_NO_CUDA
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(args.device)}
    status = EXIT_OK
    try:
        results["pinned_gb_s"] = bandwidth(args, torch, pinned=True)
        results["pageable_gb_s"] = bandwidth(args, torch, pinned=False)
        batch_bytes = args.leaves * args.leaf_kb * 1024 * args.batch_size
        results["batch_mb"] = batch_bytes / 1e6
        results.update(overlap(args, torch, batch_bytes / (results["pinned_gb_s"] * 1e9)))
    except AssertionError as error:
        results["error"] = str(error)
        status = EXIT_CHECK_FAILED
    for key, value in results.items():
        print(f"{key:>22}  {value:.3f}" if isinstance(value, float) else f"{key:>22}  {value}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(results, out, indent=2)
    return status


if __name__ == "__main__":
    sys.exit(main())
