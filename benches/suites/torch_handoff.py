"""Torch hand-off: batches per second from a replay table into PyTorch CPU tensors, against
the same batches as numpy views.

A uniform replay table of ``items`` distinct Atari-like transitions (a nested pytree: obs
uint8 (84, 84, 4), next obs, action int64, reward float32, done bool, a float32[8] info
vector), ``batch`` per sample. Each way of getting a batch into torch runs for ``seconds``,
best of ``rounds`` interleaved rounds, and the consumer reads one element of every leaf of
every batch (what a learner's first use of a leaf costs at least):

- ``numpy views``: ``sample()``, read-only views into the table's batch area (no torch);
- ``writable + from_numpy``: ``sample(writable=True)``, then ``torch.from_numpy`` per leaf
  (zero-copy tensors over the same memory);
- ``writable + from_dlpack``: the same through ``torch.from_dlpack``;
- ``device="cpu"``: ``sample(device="cpu")``, tensors that own a copy (the caller's to keep);
- ``copy + from_numpy``: ``sample(copy=True)``, then ``torch.from_numpy``;
- ``dataset_iter(device="cpu", prefetch=2)``: the same tensors made by the iterator's
  thread while the consumer reads the previous batch.

Needs PyTorch in the interpreter under test (``just test-torch`` installs it into
``target/torch-site``; run with ``PYTHONPATH=target/torch-site``); without it the suite
reports that and measures nothing.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from benches import common as c

MODES = (
    "numpy views",
    "writable + from_numpy",
    "writable + from_dlpack",
    'device="cpu"',
    "copy + from_numpy",
    'dataset_iter(device="cpu", prefetch=2)',
)


def parameters(quick: bool) -> dict[str, Any]:
    if quick:
        return {"items": 2_000, "batch": 64, "seconds": 0.3, "rounds": 1}
    return {"items": 10_000, "batch": 256, "seconds": 2.0, "rounds": 3}


def limit_s(params: dict[str, Any]) -> float:
    return 120.0 + len(MODES) * float(params["seconds"]) * int(params["rounds"]) * 2


def example() -> dict[str, Any]:
    return {
        "obs": np.zeros((84, 84, 4), np.uint8),
        "next_obs": np.zeros((84, 84, 4), np.uint8),
        "action": np.zeros((), np.int64),
        "reward": np.zeros((), np.float32),
        "done": np.zeros((), np.bool_),
        "info": {"vector": np.zeros(8, np.float32)},
    }


def _leaves(tree: Any) -> list[Any]:
    out: list[Any] = []
    if isinstance(tree, dict):
        for v in tree.values():
            out += _leaves(v)
    else:
        out.append(tree)
    return out


def measure(params: dict[str, Any]) -> dict[str, Any]:
    import echo

    c.watchdog(limit_s(params))
    try:
        import torch
    except ImportError as e:
        return {"error": f"PyTorch is not installed ({e}): run `just test-torch` first"}
    items, batch = int(params["items"]), int(params["batch"])
    seconds, rounds = float(params["seconds"]), int(params["rounds"])
    server = echo.Server(example(), batch, sampler=echo.Uniform(), max_size=items, seed=1)
    rng = np.random.default_rng(0)
    for i in range(items):
        frame = rng.integers(0, 255, (84, 84, 4), np.uint8)
        server.submit(
            {
                "obs": frame,
                "next_obs": frame,
                "action": np.asarray(i, np.int64),
                "reward": np.asarray(i, np.float32),
                "done": np.asarray(i % 100 == 99),
                "info": {"vector": np.full(8, i, np.float32)},
            }
        )

    def read_numpy(leaves: list[Any]) -> float:
        return sum(float(a.flat[-1]) for a in leaves)

    def read_tensors(tensors: list[Any]) -> float:
        return sum(float(t.reshape(-1)[-1]) for t in tensors)

    def one(mode: str) -> float:
        if mode == "numpy views":
            s = server.sample()
            assert s is not None
            return read_numpy(_leaves(s.batch))
        if mode == "writable + from_numpy":
            s = server.sample(writable=True)
            assert s is not None
            return read_tensors([torch.from_numpy(a) for a in _leaves(s.batch)])
        if mode == "writable + from_dlpack":
            s = server.sample(writable=True)
            assert s is not None
            return read_tensors([torch.from_dlpack(a) for a in _leaves(s.batch)])
        if mode == 'device="cpu"':
            s = server.sample(device="cpu")
            assert s is not None
            return read_tensors(_leaves(s.batch))
        s = server.sample(copy=True)
        assert s is not None
        return read_tensors([torch.from_numpy(a) for a in _leaves(s.batch)])

    def timed(mode: str) -> tuple[int, float, float]:
        """Batches taken in `seconds` (after one to warm up), the time, and the checksum."""
        iterator = None
        if mode.startswith("dataset_iter"):
            iterator = iter(server.dataset_iter(device="cpu", prefetch=2))

            def take() -> float:
                return read_tensors(_leaves(next(iterator).batch))
        else:

            def take() -> float:
                return one(mode)

        take()  # warm: the first batch of a mode pays its imports and caches
        total, n, t0 = 0.0, 0, time.perf_counter()
        deadline = t0 + seconds
        for _ in range(10_000_000):
            total += take()
            n += 1
            if time.perf_counter() >= deadline:
                break
        elapsed = time.perf_counter() - t0
        if iterator is not None:
            iterator.close()  # type: ignore[attr-defined]  # a generator
        return n, elapsed, total

    best: dict[str, float] = {m: 0.0 for m in MODES}
    bytes_per_batch = batch * sum(a.nbytes for a in _leaves(example()))
    checks = 0.0
    for _ in range(rounds):
        for mode in MODES:
            n, elapsed, total = timed(mode)
            checks += total
            best[mode] = max(best[mode], n / elapsed)
    server.close()
    return {
        "torch": torch.__version__,
        "batches_per_s": {m: round(v, 1) for m, v in best.items()},
        "bytes_per_batch": bytes_per_batch,
        "correct": bool(np.isfinite(checks)),
    }


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    columns = ["echo", "torch", "way into torch", "batches/s", "GB/s", "of numpy views"]
    rows = c.failed_rows(results, len(columns))
    for side, r in results.items():
        if "error" in r:
            continue
        base = r["batches_per_s"]["numpy views"]
        for mode in MODES:
            rate = r["batches_per_s"][mode]
            rows.append(
                [
                    side,
                    r["torch"],
                    mode,
                    f"{rate:,.0f}",
                    f"{rate * r['bytes_per_batch'] / 1e9:.2f}",
                    f"{rate / base:.2f}x" if base else "-",
                ]
            )
    return [
        {
            "title": f"Uniform samples of {params['batch']} from {params['items']:,} Atari-like "
            "transitions (a nested pytree of 7 leaves) into PyTorch CPU tensors, every leaf "
            f"of every batch read; best of {params['rounds']} rounds of {params['seconds']} s",
            "columns": columns,
            "rows": rows,
            "notes": [
                "*of numpy views*: batches/s as a fraction of plain `sample()` views "
                "(read-only, no torch).",
                "`writable=True` views handed to `torch.from_numpy` or `torch.from_dlpack` are "
                'zero-copy; `device="cpu"` and `copy=True` copy the batch into memory the '
                "caller keeps (one copy, made with the GIL released, adopted by "
                "`torch.from_numpy`); `dataset_iter(device=...)` makes it in a thread of "
                "its own.",
            ],
        }
    ]
