"""Compressed replay: what ``Server(compress={"obs": echo.Zstd(1)})`` costs and saves on real
Atari steps, against the same table uncompressed, and against a Python ``zstandard`` loop and
TorchRL's ``CompressedListStorage``, with the targets of the compressed-observations issue.

An item is one DQN Atari step, ``{"obs": u8[84,84,4], "action": i64[], "reward": f32[],
"done": bool[]}`` (28,237 bytes raw). The observations are stacks of 4 consecutive frames of
one episode from seeded random play of Pong, Breakout and MsPacman (``benches/atari_frames.py``:
``pool_steps`` steps per game, generated once into ``target/atari-frames``; ``--set
fixture=PATH`` reads a file that script wrote instead). Tables are filled by cycling through
that pool (each item is compressed on its own, so a cycled pool of a few thousand real
observations is representative of a long run; no codec sees two items at once). ``action``
holds the item's index in the pool, so every batch that is checked is compared, row by row,
with the pool: bit-exact or ``correct`` is False. ``mixed``: the three games' pools one after
the other.

Each of the first three parts runs in child processes (this file, run by this interpreter or
TorchRL's), each bounded by a time limit and ended (its process group) past it; the wire
part's server runs in the suite's own process, its relay and workers in child processes:

1. **memory**: per game and mixed, ``VmRSS`` after filling a table with ``submit_batch`` of
   ``chunk`` rows, minus ``VmRSS`` just before the server was built (the pool already loaded;
   ``malloc_trim`` and a settled reading both times). Compressed (zstd-1; LZ4 for mixed) at
   ``memory_items`` items; uncompressed at ``memory_raw_items`` (1e6 uncompressed items are
   28 GB, more than a 24 GiB machine has), scaled linearly to ``memory_items``: its bytes
   per item are the slots' raw bytes plus nothing that depends on the count, which a second
   size (half as many, mixed) checks. Also ``stats()``: stored and raw bytes and
   ``compression_ratio``, and the fill rate of the empty table.
2. **throughput**: one process holds the same ``items`` mixed items in three tables
   (uncompressed, zstd-1, LZ4, batch 256) and in the Python ``zstandard`` baseline below,
   and times windows of ``seconds``: ``sample()`` batches/s with a consumer that reads every
   byte of each batch's ``obs``, ``np.copyto`` into a preallocated array (*copy*) or
   ``obs.sum()`` (*sum*), the same for every table; and inserts/s into the full table (each
   insert evicts the oldest, a long run's steady state) with ``submit`` one sample at a time
   and ``submit_batch`` of ``rows`` rows, from the pool's distinct items. Per repeat and
   operation the tables run back to back, in an order that rotates, and a ratio is the
   median over the repeats of the two adjacent windows' ratio: on a shared machine a busy
   moment then hits both sides of a ratio. The CPU time of this process and of every other
   process on the machine (``/proc/stat``) is recorded per window.
3. **baselines**: a Python ``zstandard`` loop (level 1; a list of one compressed ``bytes``
   per item; sampling draws 256 indices and decompresses each into a preallocated batch
   array): its RSS at ``baseline_items`` items in its own child, its rates in the
   throughput process; and, with ``--set torchrl=PYTHON`` (an interpreter with torchrl,
   never installed with echo), TorchRL's ``ReplayBuffer(storage=CompressedListStorage(
   compression_level=1))`` at ``torchrl_items`` items, in its own process, through its
   public API only, one window per measurement.
4. **wire**: a ``Server(..., compress={"obs": Zstd(1)}, transport=TcpTransport(port=0,
   host="127.0.0.1", shared_memory=False))`` and ``workers`` worker processes, each a
   ``TcpClient(shared_memory=False)`` calling ``send()`` per step from the pool, directly
   and through a relay process on loopback (a thread pair per connection, a token bucket
   per direction at ``rate_mbit`` Mb/s, or none: the relay's own ceiling). Samples/s is what
   the server's drainers moved (``samples_inserted_total``) in the window after ``warmup``.
   With wire compression (a ``wire_compression`` keyword of ``TcpClient``) and without
   (``wire_compression=False``); an echo without that keyword is measured without only and
   the *with* column says "not available". The relay's own ceiling: raw bytes/s of one
   connection sending 1 MiB chunks through it, unlimited and at ``rate_mbit``, next to the
   same without the relay.

Without ale-py (the ``bench`` extra) and no cached frames, the suite measures nothing and its
record says why. Loopback only; every loop is bounded in count and time; the children it
starts are the only processes it ends. Run: ``python -m benches compression [--quick]
[--set torchrl=PYTHON]``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benches import common as c

ROOT = c.ROOT
GAMES = ("pong", "breakout", "ms_pacman")
GAME_NAMES = {"pong": "Pong", "breakout": "Breakout", "ms_pacman": "MsPacman", "mixed": "mixed"}
CODECS = ("none", "zstd-1", "lz4")
PY_ZSTD = "py-zstd"  # the Python zstandard loop, in the throughput process beside echo's tables
CODEC_LABELS = {"none": "uncompressed", "zstd-1": "zstd-1", "lz4": "LZ4"}
BATCH = 256
CONSUMERS = ("copy", "sum")
INSERTS = ("submit", "submit_batch")
MAX_CALLS = 10_000_000  # bound on the calls of one timed window (its seconds come first)
RELAY_CHUNK = 256 * 1024
BLAST_CHUNK = 1 << 20
# The targets.
MEMORY_TARGET = 1 / 8  # compressed RSS at most this fraction of uncompressed
SAMPLE_TARGET = 0.5  # batches/s at least this fraction of uncompressed
INSERT_TARGET = 0.5
WIRE_RELAY_TARGET = 4.0  # samples/s with / without wire compression through the 1 Gb/s link
WIRE_DIRECT_TARGET = 0.8  # the same, direct loopback
NOT_AVAILABLE = "not available"


def parameters(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "games": list(GAMES),
            "pool_steps": 400,
            "seed": 0,
            "fixture": None,
            "memory_items": 20_000,
            "memory_raw_items": 5_000,
            "chunk": 1024,
            "items": 5_000,
            "rows": 64,
            "seconds": 0.3,
            "repeats": 1,
            "baseline_items": 5_000,
            "torchrl": None,
            "torchrl_items": 2_000,
            "workers": 2,
            "wire_seconds": 0.6,
            "wire_warmup": 0.3,
            "rate_mbit": 1000,
        }
    return {
        "games": list(GAMES),
        "pool_steps": 3000,
        "seed": 0,
        "fixture": None,
        "memory_items": 1_000_000,
        "memory_raw_items": 100_000,
        "chunk": 1024,
        "items": 100_000,
        "rows": 64,
        "seconds": 1.5,
        "repeats": 5,
        "baseline_items": 1_000_000,
        "torchrl": None,
        "torchrl_items": 100_000,
        "workers": 2,
        "wire_seconds": 3.0,
        "wire_warmup": 1.0,
        "rate_mbit": 1000,
    }


def _memory_cases(params: dict[str, Any]) -> list[dict[str, Any]]:
    full, raw = int(params["memory_items"]), int(params["memory_raw_items"])
    cases = []
    for game in [*params["games"], "mixed"]:
        cases.append({"game": game, "codec": "none", "items": raw})
        cases.append({"game": game, "codec": "zstd-1", "items": full})
    # Linearity checks (mixed): uncompressed at half the size, zstd-1 at a tenth; and LZ4.
    cases.append({"game": "mixed", "codec": "none", "items": max(1, raw // 2)})
    cases.append({"game": "mixed", "codec": "zstd-1", "items": max(1, full // 10)})
    cases.append({"game": "mixed", "codec": "lz4", "items": full})
    return cases


def _case_limit(case: dict[str, Any], params: dict[str, Any]) -> float:
    """A child's time limit: start-up plus a generous floor on each phase's rate."""
    kind = case["kind"]
    if kind == "memory":
        return 60.0 + case["items"] / 10_000
    if kind == "throughput":
        tables = len(CODECS) + 1  # and the Python zstandard loop's
        windows = tables * (len(CONSUMERS) + len(INSERTS)) * int(params["repeats"])
        fill = tables * int(params["items"]) / 5_000
        return 120.0 + fill + 2 * windows * (float(params["seconds"]) + 1.0)
    if kind == "zstandard":
        return 60.0 + int(params["baseline_items"]) / 5_000
    if kind == "torchrl":
        return 180.0 + int(params["torchrl_items"]) / 500 + 20 * float(params["seconds"])
    raise ValueError(kind)


def _wire_cases(params: dict[str, Any]) -> list[str]:
    return ["direct", "relay-limited", "relay-unlimited"]


def _wire_limit(params: dict[str, Any]) -> float:
    per_case = 90.0 + 2 * (float(params["wire_seconds"]) + float(params["wire_warmup"]))
    blasts = 4 * (float(params["wire_seconds"]) + 20.0)
    return 2 * len(_wire_cases(params)) * per_case + blasts


def limit_s(params: dict[str, Any]) -> float:
    cases = [{"kind": "memory", **m} for m in _memory_cases(params)]
    cases += [{"kind": k} for k in ("throughput", "zstandard")]
    cases += [{"kind": "torchrl"}] if params.get("torchrl") else []
    return 120.0 + sum(_case_limit(k, params) for k in cases) + _wire_limit(params)


# --------------------------------------------------------------------------- the pool


def load_frames(params: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every game's frames and episode starts: the fixture's, or the cached rollouts."""
    from benches import atari_frames as af

    if params.get("fixture"):
        games, _ = af.load(Path(params["fixture"]))
        return {g: games[g] for g in params["games"]}
    return af.cached(int(params["pool_steps"]), int(params["seed"]), params["games"])


def why_no_frames(params: dict[str, Any]) -> str | None:
    """Why there are no Atari frames to measure on, or None when there are."""
    from benches import atari_frames as af

    if params.get("fixture"):
        return None if Path(params["fixture"]).exists() else f"no file {params['fixture']}"
    steps, seed = int(params["pool_steps"]), int(params["seed"])
    cached = all(
        (af.CACHE / f"{g}-seed{seed}-steps{steps}-area-v{af.VERSION}.npz").exists()
        for g in params["games"]
    )
    if cached or importlib.util.find_spec("ale_py") is not None:
        return None
    return "ale-py is not installed (the bench extra) and no frames are cached: nothing to measure"


def pool(params: dict[str, Any], game: str, limit: int | None = None) -> Any:
    """The ``(P, 84, 84, 4) uint8`` observations items cycle through: one game's, or every
    game's one after the other (``mixed``); the first ``limit`` of each game when given."""
    import numpy as np

    from benches import atari_frames as af

    frames = load_frames(params)
    games = list(params["games"]) if game == "mixed" else [game]
    parts = [af.observations(frames[g]["frames"], frames[g]["episode_start"]) for g in games]
    return np.ascontiguousarray(np.concatenate([p[:limit] for p in parts]))


def example() -> dict[str, Any]:
    import numpy as np

    return {
        "obs": np.zeros((84, 84, 4), np.uint8),
        "action": np.zeros((), np.int64),
        "reward": np.zeros((), np.float32),
        "done": np.zeros((), np.bool_),
    }


def _rows(obs: Any, start: int, n: int) -> dict[str, Any]:
    """``n`` items from pool row ``start`` on (no wrap: the caller keeps it in range)."""
    import numpy as np

    index = np.arange(start, start + n, dtype=np.int64)
    return {
        "obs": obs[start : start + n],
        "action": index,
        "reward": (index % 7).astype(np.float32),
        "done": index % 500 == 499,
    }


def _one(obs: Any, i: int) -> dict[str, Any]:
    import numpy as np

    return {
        "obs": obs[i],
        "action": np.int64(i),
        "reward": np.float32(i % 7),
        "done": np.bool_(i % 500 == 499),
    }


def _check(batch_obs: Any, actions: Any, obs: Any) -> bool:
    """Every row of a batch is the pool's item its ``action`` names, bit-exact."""
    import numpy as np

    idx = np.asarray(actions, np.int64)
    if idx.min() < 0 or idx.max() >= len(obs):
        return False
    return bool(np.array_equal(np.asarray(batch_obs), obs[idx]))


def codec(name: str) -> Any:
    import echo

    return {"none": None, "zstd-1": {"obs": echo.Zstd(1)}, "lz4": {"obs": echo.Lz4()}}[name]


def _fill(server: Any, obs: Any, items: int, chunk: int) -> float:
    """``submit_batch`` of ``chunk`` rows until ``items`` are in; the seconds it took."""
    t0 = time.perf_counter()
    done, start = 0, 0
    for _ in range(items + 1):  # each call inserts at least one
        if done >= items:
            break
        n = min(chunk, items - done, len(obs) - start)
        server.submit_batch(_rows(obs, start, n))
        done += n
        start = (start + n) % len(obs)
    return time.perf_counter() - t0


def timed(fn: Any, seconds: float, per_call: int = 1) -> float:
    """Calls ``fn`` (two untimed first) for ``seconds`` (at most ``MAX_CALLS``); per second."""
    for _ in range(2):
        fn()
    calls, t0 = 0, time.perf_counter()
    deadline = t0 + seconds
    while calls < MAX_CALLS:
        fn()
        calls += 1
        if time.perf_counter() >= deadline:
            break
    return calls * per_call / (time.perf_counter() - t0)


# --------------------------------------------------------------------------- children


def _memory_case(params: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    import echo

    obs = pool(params, case["game"])
    items = int(case["items"])
    c.malloc_trim()
    before = c.settle_rss(max_s=5.0)
    server = echo.Server(
        example(),
        BATCH,
        sampler=echo.Uniform(),
        max_size=items,
        seed=1,
        compress=codec(case["codec"]),
    )
    fill_s = _fill(server, obs, items, int(params["chunk"]))
    c.malloc_trim()
    after = c.settle_rss(max_s=10.0)
    st = server.stats()
    correct = st.store_size == items
    for _ in range(2):
        got = server.sample(timeout=30)
        correct = correct and got is not None and _check(got.batch["obs"], got.batch["action"], obs)
    server.close()
    return {
        **case,
        "pool": len(obs),
        "rss_before_mib": before,
        "rss_mib": after - before,
        "rss_bytes_per_item": (after - before) * c.MIB / items,
        "stored_bytes": st.stored_bytes,
        "raw_bytes": st.raw_bytes,
        "compression_ratio": st.compression_ratio,
        "fill_per_s": items / fill_s,
        "correct": bool(correct),
    }


class _EchoTable:
    """A Server replay table behind the four operations the throughput windows time."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def fill(self, obs: Any, items: int, chunk: int) -> float:
        return _fill(self.server, obs, items, chunk)

    def sample(self) -> dict[str, Any]:
        return self.server.sample(timeout=30).batch

    def submit(self, item: dict[str, Any]) -> None:
        self.server.submit(item)

    def submit_batch(self, rows: dict[str, Any]) -> None:
        self.server.submit_batch(rows)

    def close(self) -> None:
        self.server.close()


class _PyZstdTable:
    """The baseline: a Python list of one ``zstandard`` level-1 frame per item (the other
    leaves in numpy arrays), a ring of ``n`` items; a sample draws 256 indices and
    decompresses each into a preallocated batch."""

    def __init__(self, n: int, item_shape: tuple[int, ...], seed: int) -> None:
        import numpy as np
        import zstandard

        self.n, self.pos, self.size = n, 0, 0
        self.compress = zstandard.ZstdCompressor(level=1).compress
        self.decompress = zstandard.ZstdDecompressor().decompress
        self.frames: list[bytes] = [b""] * n
        self.action = np.zeros(n, np.int64)
        self.reward = np.zeros(n, np.float32)
        self.done = np.zeros(n, np.bool_)
        self.rng = np.random.default_rng(seed)
        self.batch = {
            "obs": np.empty((BATCH, *item_shape), np.uint8),
            "action": np.empty(BATCH, np.int64),
            "reward": np.empty(BATCH, np.float32),
            "done": np.empty(BATCH, np.bool_),
        }
        self.flat = self.batch["obs"].reshape(BATCH, -1)

    def submit(self, item: dict[str, Any]) -> None:
        p = self.pos
        self.frames[p] = self.compress(item["obs"])
        self.action[p], self.reward[p], self.done[p] = item["action"], item["reward"], item["done"]
        self.pos = (p + 1) % self.n
        self.size = min(self.n, self.size + 1)

    def submit_batch(self, rows: dict[str, Any]) -> None:
        for i in range(len(rows["action"])):
            self.submit({k: v[i] for k, v in rows.items()})

    def fill(self, obs: Any, items: int, chunk: int) -> float:
        t0 = time.perf_counter()
        for i in range(items):
            self.submit(_one(obs, i % len(obs)))
        return time.perf_counter() - t0

    def sample(self) -> dict[str, Any]:
        import numpy as np

        idx = self.rng.integers(0, self.size, BATCH)
        for row, k in enumerate(idx.tolist()):
            self.flat[row] = np.frombuffer(self.decompress(self.frames[k]), np.uint8)
        np.take(self.action, idx, out=self.batch["action"])
        np.take(self.reward, idx, out=self.batch["reward"])
        np.take(self.done, idx, out=self.batch["done"])
        return self.batch

    def close(self) -> None:
        self.frames = []


def machine_busy() -> tuple[int, int] | None:
    """``/proc/stat``'s total and idle (with iowait) jiffies of all CPUs, or None."""
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(v), v[3] + v[4]


def _throughput_case(params: dict[str, Any]) -> dict[str, Any]:
    """The same items in three echo tables (and the Python zstandard baseline's), the
    operations timed in windows: per repeat and operation, every table back to back (the
    order rotating), so a busy moment on a shared machine hits the tables it compares."""
    import numpy as np

    import echo

    obs = pool(params, "mixed")
    items, rows, seconds = int(params["items"]), int(params["rows"]), float(params["seconds"])
    tables: dict[str, Any] = {
        name: _EchoTable(
            echo.Server(
                example(),
                BATCH,
                sampler=echo.Uniform(),
                max_size=items,
                seed=2,
                compress=codec(name),
            )
        )
        for name in CODECS
    }
    if importlib.util.find_spec("zstandard") is not None:
        tables[PY_ZSTD] = _PyZstdTable(items, obs.shape[1:], seed=2)
    out: dict[str, Any] = {"items": items, "pool": len(obs), "correct": True, "fill_per_s": {}}
    for name, table in tables.items():
        out["fill_per_s"][name] = items / table.fill(obs, items, int(params["chunk"]))
        if name in CODECS:
            out.setdefault("compression_ratio", {})[name] = table.server.stats().compression_ratio
    dst = np.empty((BATCH, *obs.shape[1:]), np.uint8)
    singles = [_one(obs, i) for i in range(len(obs))]
    starts = list(range(0, len(obs) - rows + 1, rows))
    nxt = [0]  # the next pool item (submit) or chunk (submit_batch) to insert

    def copy(t: Any) -> None:
        np.copyto(dst, t.sample()["obs"])

    def total(t: Any) -> None:
        t.sample()["obs"].sum()

    def one(t: Any) -> None:
        t.submit(singles[nxt[0] % len(singles)])
        nxt[0] += 1

    def many(t: Any) -> None:
        t.submit_batch(_rows(obs, starts[nxt[0] % len(starts)], rows))
        nxt[0] += 1

    ops = {"sample/copy": (copy, 1), "sample/sum": (total, 1)}
    ops |= {"insert/submit": (one, 1), "insert/submit_batch": (many, rows)}
    runs: dict[str, list[float]] = {}
    own: dict[str, list[float]] = {}
    others: dict[str, list[float]] = {}
    names = list(tables)
    for rep in range(int(params["repeats"])):
        for op, (fn, per_call) in ops.items():
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                table, key = tables[name], f"{op}/{name}"
                batch = table.sample()
                out["correct"] = out["correct"] and _check(batch["obs"], batch["action"], obs)
                m0, c0, w0 = machine_busy(), time.process_time(), time.perf_counter()
                runs.setdefault(key, []).append(
                    timed(lambda t=table, f=fn: f(t), seconds, per_call)
                )
                m1, c1, w1 = machine_busy(), time.process_time(), time.perf_counter()
                own.setdefault(key, []).append((c1 - c0) / (w1 - w0))
                if m0 is not None and m1 is not None and m1[0] > m0[0]:
                    busy = (os.cpu_count() or 1) * (1 - (m1[1] - m0[1]) / (m1[0] - m0[0]))
                    others.setdefault(key, []).append(max(0.0, busy - own[key][-1]))
    for table in tables.values():
        batch = table.sample()
        out["correct"] = out["correct"] and _check(batch["obs"], batch["action"], obs)
        table.close()
    out["rates"] = {k: statistics.median(v) for k, v in runs.items()}
    out["runs"] = runs
    out["cpu_cores"] = {k: statistics.median(v) for k, v in own.items()}
    out["others_cpu_cores"] = {k: statistics.median(v) for k, v in others.items()}
    out["codec_gb_s"] = _codec_reference(obs, seconds)
    return out


def _codec_reference(obs: Any, seconds: float) -> dict[str, float]:
    """One-core GB/s (raw bytes) at which libzstd level 1 and liblz4, through the Python
    ``zstandard`` and ``lz4`` packages, compress and decompress the pool's observations:
    what one core does with those libraries, next to echo's rates. Empty without them."""
    try:
        import lz4.block
        import zstandard
    except ImportError:
        return {}
    cctx, dctx = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    codecs = {
        "zstd-1": (cctx.compress, dctx.decompress),
        "lz4": (lambda b: lz4.block.compress(b, store_size=True), lz4.block.decompress),
    }
    items = [obs[i].tobytes() for i in range(0, len(obs), max(1, len(obs) // 1000))]
    raw = sum(len(x) for x in items)
    out: dict[str, float] = {}
    for name, (comp, decomp) in codecs.items():
        packed = [comp(x) for x in items]
        for what, fn, xs in (("compress", comp, items), ("decompress", decomp, packed)):
            passes = timed(lambda fn=fn, xs=xs: [fn(x) for x in xs], seconds / 4)
            out[f"{name}/{what}"] = passes * raw / 1e9
    return out


def _zstandard_case(params: dict[str, Any]) -> dict[str, Any]:
    """The baseline's memory: ``baseline_items`` items in a :class:`_PyZstdTable` (its rates
    are measured in the throughput process, beside echo's tables)."""
    import zstandard

    obs = pool(params, "mixed")
    n = int(params["baseline_items"])
    table = _PyZstdTable(n, obs.shape[1:], seed=3)
    table.submit(_one(obs, 0))  # the codec contexts' buffers, before the baseline: not per item
    table.pos, table.size = 0, 0
    c.malloc_trim()
    before = c.settle_rss(max_s=5.0)
    fill_s = table.fill(obs, n, int(params["chunk"]))
    c.malloc_trim()
    after = c.settle_rss(max_s=10.0)
    correct = all(_check(b["obs"], b["action"], obs) for b in (table.sample(), table.sample()))
    return {
        "zstandard": zstandard.__version__,
        "items": n,
        "rss_mib": after - before,
        "rss_bytes_per_item": (after - before) * c.MIB / n,
        "stored_bytes": sum(len(b) for b in table.frames),
        "fill_per_s": n / fill_s,
        "correct": bool(correct),
    }


def _torchrl_case(params: dict[str, Any]) -> dict[str, Any]:
    """TorchRL's ``CompressedListStorage`` (zstd level 1) through its public API, run by an
    interpreter that has torchrl (and no echo)."""
    import numpy as np
    import tensordict
    import torch
    import torchrl
    from tensordict import TensorDict
    from torchrl.data import CompressedListStorage, ReplayBuffer
    from torchrl.data.replay_buffers.samplers import RandomSampler

    obs_np = pool(params, "mixed")
    obs = torch.from_numpy(obs_np)
    n, rows, seconds = int(params["torchrl_items"]), int(params["rows"]), float(params["seconds"])

    def items(start: int, k: int) -> Any:
        idx = torch.arange(start, start + k, dtype=torch.int64)
        return TensorDict(
            {
                "obs": obs[start : start + k],
                "action": idx,
                "reward": (idx % 7).to(torch.float32),
                "done": idx % 500 == 499,
            },
            batch_size=[k],
        )

    c.malloc_trim()
    before = c.settle_rss(max_s=5.0)
    storage = CompressedListStorage(max_size=n, compression_level=1)
    rb = ReplayBuffer(storage=storage, batch_size=BATCH, sampler=RandomSampler())
    chunk = int(params["chunk"])
    t0 = time.perf_counter()
    done, start = 0, 0
    while done < n:
        k = min(chunk, n - done, len(obs) - start)
        rb.extend(items(start, k))
        done += k
        start = (start + k) % len(obs)
    fill_s = time.perf_counter() - t0
    c.malloc_trim()
    after = c.settle_rss(max_s=10.0)

    def checked() -> bool:
        s = rb.sample()
        return _check(s["obs"].numpy(), s["action"].numpy(), obs_np)

    correct = checked() and checked()
    dst = torch.empty((BATCH, *obs.shape[1:]), dtype=torch.uint8)
    pos = [0]

    def one() -> None:
        j = pos[0] % len(obs)
        rb.add(items(j, 1)[0])
        pos[0] += 1

    def many() -> None:
        j = (pos[0] * rows) % (len(obs) - rows + 1)
        rb.extend(items(j, rows))
        pos[0] += 1

    rates = {
        "sample/copy": timed(lambda: dst.copy_(rb.sample()["obs"]), seconds),
        "sample/sum": timed(lambda: rb.sample()["obs"].sum(), seconds),
        "insert/submit": timed(one, seconds),
    }
    pos[0] = 0
    rates["insert/submit_batch"] = timed(many, seconds, rows)
    correct = correct and checked()
    return {
        "torch": torch.__version__,
        "torchrl": torchrl.__version__,
        "tensordict": tensordict.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": np.__version__,
        "items": n,
        "rss_mib": after - before,
        "rss_bytes_per_item": (after - before) * c.MIB / n,
        "fill_per_s": n / fill_s,
        "rates": rates,
        "correct": bool(correct),
    }


def run_case(
    python: str,
    case: dict[str, Any],
    params: dict[str, Any],
    limit: float | None = None,
    module: str = "benches.suites.compression",
) -> dict[str, Any]:
    """Runs one case in a child process of ``python`` (``module``'s ``case`` command, from
    the repository root), bounded by ``limit`` seconds (this suite's limit for the case by
    default); its result, or ``{"error": ...}``."""
    limit = _case_limit(case, params) if limit is None else limit
    cmd = [python, "-m", module, "case", json.dumps(params)]
    cmd.append(json.dumps(case))
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group of the child started here
        proc.communicate()
        return {"error": f"{case['kind']}: over its {limit:.0f} s limit"}
    what = " ".join(str(case.get(k, "")) for k in ("kind", "game", "codec", "items"))
    print(
        f"{module.rsplit('.', 1)[-1]}: {what}: {time.monotonic() - t0:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    try:
        doc: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"{case['kind']}: exit status {proc.returncode}: {err.strip()[-400:]}"}
    return doc


def case_main(params: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    c.watchdog(_case_limit(case, params))
    kind = case["kind"]
    if kind == "memory":
        return _memory_case(params, case)
    if kind == "throughput":
        return _throughput_case(params)
    if kind == "zstandard":
        return _zstandard_case(params)
    if kind == "torchrl":
        return _torchrl_case(params)
    raise ValueError(f"no case {kind!r}")


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
        cmd = [sys.executable, "-m", "benches.suites.compression", "relay", str(target_port)]
        cmd += [str(rate_mbit * 1e6 / 8), str(seconds)]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
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
    singles = [_one(obs, i) for i in range(len(obs))]
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
            cmd = [sys.executable, "-m", "benches.suites.compression", "worker"]
            cmd.append(json.dumps({**spec, "wid": wid}))
            procs.append(
                subprocess.Popen(
                    cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
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
        item_bytes = sum(x.nbytes for x in _one(obs, 0).values())
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
            and _check(got.batch["obs"], got.batch["action"], obs)
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


def _wire(params: dict[str, Any]) -> dict[str, Any]:
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
    for i, path in enumerate(_wire_cases(params)):
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


# --------------------------------------------------------------------------- measure


def measure(params: dict[str, Any]) -> dict[str, Any]:
    watchdog = c.watchdog(limit_s(params))
    try:
        return _measure(params)
    finally:
        watchdog.cancel()  # measured in-process (the tests): the caller goes on


def _measure(params: dict[str, Any]) -> dict[str, Any]:
    why = why_no_frames(params)
    if why is not None:
        return {"skipped": why, "correct": True}
    obs = pool(params, "mixed")  # generates the frames into the cache once, here
    out: dict[str, Any] = {
        "loadavg_start": c.loadavg(),
        "pool_per_game": len(obs) // len(params["games"]),
        "item_raw_bytes": sum(x.nbytes for x in _one(obs, 0).values()),
        "memory": [],
    }
    del obs
    py = sys.executable
    for case in _memory_cases(params):
        out["memory"].append({**case, **run_case(py, {"kind": "memory", **case}, params)})
    out["throughput"] = run_case(py, {"kind": "throughput"}, params)
    if importlib.util.find_spec("zstandard") is None:
        out["zstandard"] = {"skipped": "the zstandard package is not installed"}
    else:
        out["zstandard"] = run_case(py, {"kind": "zstandard"}, params)
    if params.get("torchrl"):
        out["torchrl"] = run_case(str(params["torchrl"]), {"kind": "torchrl"}, params)
    else:
        out["torchrl"] = {"skipped": "no --set torchrl=PYTHON (an interpreter with torchrl)"}
    out["wire"] = _wire(params)
    out["loadavg_end"] = c.loadavg()
    parts = [*out["memory"], out["throughput"], out["wire"]]
    parts += [out[k] for k in ("zstandard", "torchrl") if "skipped" not in out[k]]
    out["correct"] = all("error" not in p and p.get("correct") for p in parts)
    out["targets"] = targets(out, params)
    return out


# --------------------------------------------------------------------------- targets, tables


def _memory_summary(res: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    """Per game (and mixed): the compressed table's RSS at ``memory_items`` against the
    uncompressed one's, scaled from ``memory_raw_items``."""
    full, raw = int(params["memory_items"]), int(params["memory_raw_items"])
    rows = []
    for game in [*params["games"], "mixed"]:
        by = {
            (m["codec"], m["items"]): m
            for m in res["memory"]
            if m["game"] == game and "error" not in m
        }
        plain = by.get(("none", raw))
        for codec in ("zstd-1", "lz4"):
            comp = by.get((codec, full))
            if comp is None:
                continue
            row = {"game": game, "codec": codec, "items": full}
            row["rss_bytes_per_item"] = comp["rss_bytes_per_item"]
            row["stored_bytes_per_item"] = comp["stored_bytes"] / full
            row["compression_ratio"] = comp["compression_ratio"]
            row["rss_gib"] = comp["rss_mib"] / 1024
            if plain is not None:
                row["raw_rss_bytes_per_item"] = plain["rss_bytes_per_item"]
                row["raw_rss_gib_scaled"] = plain["rss_bytes_per_item"] * full / 2**30
                row["fraction"] = comp["rss_bytes_per_item"] / plain["rss_bytes_per_item"]
            rows.append(row)
    return rows


def _ratios(th: dict[str, Any], key: str, codec: str) -> list[float]:
    """Per repeat, ``codec``'s rate over the uncompressed table's, from windows run back to
    back (paired, so a busy moment of a shared machine mostly cancels)."""
    runs = th.get("runs", {})
    pairs = zip(runs.get(f"{key}/{codec}", []), runs.get(f"{key}/none", []), strict=False)
    return [a / b for a, b in pairs if b > 0]


def _ratio(th: dict[str, Any], key: str, codec: str) -> float | None:
    """The median of :func:`_ratios`; None when there are none."""
    rs = _ratios(th, key, codec)
    return statistics.median(rs) if rs else None


def _ratio_cell(th: dict[str, Any], key: str, codec: str) -> str:
    rs = _ratios(th, key, codec)
    if not rs:
        return "-"
    spread = f" ({min(rs):.2f}-{max(rs):.2f})" if len(rs) > 1 else ""
    return f"{statistics.median(rs):.2f}x{spread}"


def _wire_ratio(wire: dict[str, Any], path: str) -> float | None:
    by = {(r["path"], r["wire_compression"]): r.get("samples_per_s") for r in wire["rounds"]}
    a, b = by.get((path, True)), by.get((path, False))
    return a / b if a and b else None


def targets(res: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with what was measured and whether it is met (None: not
    measurable here)."""
    out: list[dict[str, Any]] = []
    for row in _memory_summary(res, params):
        if row["codec"] != "zstd-1" or "fraction" not in row:
            continue
        out.append(
            {
                "what": f"memory, {GAME_NAMES[row['game']]}: RSS of zstd-1 / uncompressed",
                "value": row["fraction"],
                "target": f"<= 1/{1 / MEMORY_TARGET:.0f}",
                "met": row["fraction"] <= MEMORY_TARGET,
                "shown": f"1/{1 / row['fraction']:.1f}",
            }
        )
    th = res.get("throughput", {})
    for key, codec, label in (
        ("sample/copy", "zstd-1", "sampling, copy consumer, zstd-1"),
        ("sample/copy", "lz4", "sampling, copy consumer, LZ4"),
        ("sample/sum", "zstd-1", "sampling, sum consumer, zstd-1"),
        ("sample/sum", "lz4", "sampling, sum consumer, LZ4"),
        ("insert/submit", "zstd-1", "inserts, submit, zstd-1"),
        ("insert/submit_batch", "zstd-1", f"inserts, submit_batch of {params['rows']}, zstd-1"),
        ("insert/submit", "lz4", "inserts, submit, LZ4"),
        ("insert/submit_batch", "lz4", f"inserts, submit_batch of {params['rows']}, LZ4"),
    ):
        r = _ratio(th, key, codec)
        target = SAMPLE_TARGET if key.startswith("sample") else INSERT_TARGET
        out.append(
            {
                "what": f"{label} / uncompressed",
                "value": r,
                "target": f">= {target:.2f}x",
                "met": None if r is None else r >= target,
                "shown": "-" if r is None else f"{r:.2f}x",
            }
        )
    wire = res.get("wire", {})
    for path, target, label in (
        ("relay-limited", WIRE_RELAY_TARGET, f"wire, {params['rate_mbit']:g} Mb/s relay"),
        ("direct", WIRE_DIRECT_TARGET, "wire, direct loopback"),
    ):
        r = _wire_ratio(wire, path) if wire.get("rounds") else None
        out.append(
            {
                "what": f"{label}: with / without wire compression",
                "value": r,
                "target": f">= {target:g}x",
                "met": None if r is None else r >= target,
                "shown": NOT_AVAILABLE if r is None else f"{r:.2f}x",
            }
        )
    return out


def _met(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "no")


def _sides(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The sides that measured something (failed and skipped ones are rows of their own)."""
    return [(s, r) for s, r in results.items() if "error" not in r and "skipped" not in r]


def _targets_table(results: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    cols = ["echo", "target", "measured", "required", "met"]
    rows = c.failed_rows(results, len(cols))
    for side, res in results.items():
        if "skipped" in res:
            rows.append([side, f"skipped: {res['skipped']}", "-", "-", "-"])
    for side, res in _sides(results):
        rows += [[side, t["what"], t["shown"], t["target"], _met(t["met"])] for t in res["targets"]]
    return {
        "title": "Compressed replay: the issue's targets",
        "columns": cols,
        "rows": rows,
        "notes": [
            f"memory: RSS per item of the zstd-1 table at {params['memory_items']:,} items over "
            f"the uncompressed table's at {params['memory_raw_items']:,} (scaled linearly); "
            f"sampling and inserts: tables of {params['items']:,} mixed items; wire: samples/s "
            "with over without wire compression"
        ],
    }


def _memory_table(results: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    full, raw = int(params["memory_items"]), int(params["memory_raw_items"])
    cols = ["echo", "game", "codec", "RSS bytes/item", "stored bytes/item", "stats ratio"]
    cols += [f"RSS at {full:,} items", "uncompressed RSS bytes/item"]
    cols += [f"uncompressed at {full:,} (scaled)", "RSS fraction"]
    rows = c.failed_rows(results, len(cols))
    notes: list[str] = []
    pool_size = "-"
    for side, res in _sides(results):
        pool_size = f"{res['pool_per_game']:,}"
        for m in _memory_summary(res, params):
            rows.append(
                [
                    side,
                    GAME_NAMES[m["game"]],
                    CODEC_LABELS[m["codec"]],
                    c.num(m["rss_bytes_per_item"]),
                    c.num(m["stored_bytes_per_item"]),
                    f"{m['compression_ratio']:.1f}x",
                    f"{m['rss_gib']:.2f} GiB",
                    c.num(m.get("raw_rss_bytes_per_item")),
                    c.num(m.get("raw_rss_gib_scaled"), ".1f") + " GiB",
                    f"1/{1 / m['fraction']:.1f}" if "fraction" in m else "-",
                ]
            )
        mixed = {
            (m["codec"], m["items"]): m.get("rss_bytes_per_item")
            for m in res["memory"]
            if m["game"] == "mixed"
        }
        half, tenth = max(1, raw // 2), max(1, full // 10)
        notes.append(
            f"{side}: linear in the item count (mixed, RSS bytes/item): uncompressed "
            f"{c.num(mixed.get(('none', half)))} at {half:,} items, "
            f"{c.num(mixed.get(('none', raw)))} at {raw:,}; zstd-1 "
            f"{c.num(mixed.get(('zstd-1', tenth)))} at {tenth:,}, "
            f"{c.num(mixed.get(('zstd-1', full)))} at {full:,}"
        )
        fills = {
            (m["game"], m["codec"]): m["fill_per_s"]
            for m in res["memory"]
            if m["items"] in (raw, full) and "fill_per_s" in m
        }
        per_game = [
            GAME_NAMES[g]
            + " "
            + ", ".join(f"{CODEC_LABELS[k]} {fills[g, k]:,.0f}" for k in CODECS if (g, k) in fills)
            for g in [*params["games"], "mixed"]
        ]
        notes.append(
            f"{side}: filling the empty table, submit_batch of {params['chunk']} rows, "
            "items/s: " + "; ".join(per_game)
        )
    return {
        "title": f"Memory of replay tables of Atari steps ({pool_size} real observations per "
        "game, cycled): RSS of the child process over its baseline",
        "columns": cols,
        "rows": rows,
        "notes": [
            "RSS bytes/item: (VmRSS after filling - VmRSS before the server was built) / items; "
            "stored: stats().stored_bytes / items; RSS fraction: compressed over uncompressed "
            "RSS bytes/item",
            f"uncompressed tables measured at {raw:,} items ({raw * 28_237 / 1e9:.1f} GB raw) "
            f"and scaled linearly: {full:,} of them "
            f"({full * 28_237 / 1e9:.0f} GB) do not fit this 24 GiB machine",
            *notes,
        ],
    }


RATE_ROWS = (
    ("sample/copy", "sample(), copy obs into a preallocated array", "batches/s"),
    ("sample/sum", "sample(), obs.sum()", "batches/s"),
    ("insert/submit", "submit(), one item per call, full table", "items/s"),
    ("insert/submit_batch", "submit_batch(), {rows} rows per call, full table", "items/s"),
)


def _per_core_note(side: str, th: dict[str, Any]) -> str:
    """Obs GB/s per busy core of echo's sampling and inserts, and of the libraries alone."""
    rates, cores, ref = th["rates"], th.get("cpu_cores", {}), th.get("codec_gb_s", {})
    obs_bytes = 84 * 84 * 4

    def per_core(key: str, per_call: int) -> str:
        rate, busy = rates.get(key), cores.get(key)
        return c.num(rate * per_call / busy / 1e9 if rate and busy else None, ".2f")

    echo_part = ", ".join(
        f"{CODEC_LABELS[k]} {per_core(f'sample/copy/{k}', BATCH * obs_bytes)} / "
        f"{per_core(f'insert/submit/{k}', obs_bytes)}"
        for k in CODECS
    )
    lib_part = ", ".join(
        f"{CODEC_LABELS[k]} {c.num(ref.get(f'{k}/decompress'), '.2f')} / "
        f"{c.num(ref.get(f'{k}/compress'), '.2f')}"
        for k in ("zstd-1", "lz4")
    )
    return (
        f"{side}: obs GB/s per busy core, echo sampling (copy consumer: decompression, gather "
        f"and the consumer's copy together) / inserting (submit): {echo_part}; the codecs' "
        "libraries on one core (the Python zstandard and lz4 packages, the same "
        f"observations), decompress / compress: {lib_part if ref else '-'}"
    )


def _rates_table(results: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    cols = ["echo", "operation", "unit", "uncompressed", "zstd-1", "ratio", "LZ4", "ratio"]
    rows = c.failed_rows(results, len(cols))
    notes: list[str] = []
    for side, res in _sides(results):
        th = res["throughput"]
        if "error" in th:
            rows.append([side, str(th["error"])[:120], *["-"] * (len(cols) - 2)])
            continue
        rates, cores = th["rates"], th.get("cpu_cores", {})
        others = th.get("others_cpu_cores", {})
        for key, what, unit in RATE_ROWS:
            cells = [side, what.format(rows=params["rows"]), unit]
            cells.append(c.num(rates.get(f"{key}/none")))
            for codec in ("zstd-1", "lz4"):
                cells += [c.num(rates.get(f"{key}/{codec}")), _ratio_cell(th, key, codec)]
            rows.append(cells)

        def cpu(d: dict[str, float], op: str) -> str:
            return ", ".join(
                f"{CODEC_LABELS[k]} {d[f'{op}/{k}']:.2f}" for k in CODECS if f"{op}/{k}" in d
            )

        ratio = th["compression_ratio"]
        notes.append(
            f"{side}: CPU cores (median over the windows) of this process while sampling with "
            f"the copy consumer: {cpu(cores, 'sample/copy')}; of every other process on the "
            f"machine meanwhile: {cpu(others, 'sample/copy') or '-'}; the tables' stats ratio: "
            f"zstd-1 {ratio['zstd-1']:.1f}x, LZ4 {ratio['lz4']:.1f}x"
        )
        notes.append(_per_core_note(side, th))
    return {
        "title": f"Sampling and inserts: {params['items']:,} mixed items per table, batches of "
        f"{BATCH}, median of {params['repeats']} windows of {params['seconds']:g} s each",
        "columns": cols,
        "rows": rows,
        "notes": [
            "ratio: the median over the repeats of the rate over the uncompressed table's in "
            "the window run just before or after it (the range in brackets); inserts go into "
            "the full table, each evicting the oldest (the steady state); the same consumer "
            "reads every batch of every table",
            *notes,
        ],
    }


BASE_KEYS = ("insert/submit", "insert/submit_batch", "sample/copy", "sample/sum")


def _baselines_table(results: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    full = int(params["memory_items"])
    cols = ["echo", "implementation", "items held", "RSS bytes/item"]
    cols += [f"RSS at {full:,} (scaled)", "insert 1/call, /s", f"insert {params['rows']}/call, /s"]
    cols += ["batches/s, copy", "batches/s, sum"]
    rows = c.failed_rows(results, len(cols))
    notes: list[str] = []

    def mem_cells(items: int, per_item: float) -> list[str]:
        return [f"{items:,}", c.num(per_item), f"{per_item * full / 2**30:.2f} GiB"]

    def baseline_row(
        side: str, label: str, result: dict[str, Any], rates: dict[str, Any], key: str
    ) -> bool:
        """Appends a baseline's row (or why it was not measured), its rates `rates[key %
        k]` for each of `BASE_KEYS`; whether it was measured."""
        if "skipped" in result or "error" in result:
            why = result.get("skipped") or result.get("error")
            rows.append([side, label, f"not measured: {why}"[:160], *["-"] * 6])
            return False
        rows.append(
            [
                side,
                label,
                *mem_cells(result["items"], result["rss_bytes_per_item"]),
                *(c.num(rates.get(key % k)) for k in BASE_KEYS),
            ]
        )
        return True

    for side, res in _sides(results):
        mixed = {(m["game"], m["codec"]): m for m in _memory_summary(res, params)}
        echo_mem = mixed.get(("mixed", "zstd-1"))
        rates = res["throughput"].get("rates", {})
        if echo_mem is not None:
            rows.append(
                [
                    side,
                    "echo, compress={'obs': Zstd(1)}",
                    *mem_cells(full, echo_mem["rss_bytes_per_item"]),
                    *(c.num(rates.get(f"{k}/zstd-1")) for k in BASE_KEYS),
                ]
            )
        b = res.get("zstandard", {})
        label = "Python loop: zstandard level 1, a list of bytes"
        if baseline_row(side, label, b, rates, f"%s/{PY_ZSTD}"):
            notes.append(
                f"{side}: zstandard {b['zstandard']}, one compress() per item in a Python loop "
                "(so one item or a batch per call is the same); its rates come from the "
                "throughput process, windows alternating with echo's tables on the same items"
            )
        t = res.get("torchrl", {})
        label = "TorchRL CompressedListStorage, level 1"
        if baseline_row(side, label, t, t.get("rates", {}), "%s"):
            notes.append(
                f"{side}: TorchRL {t['torchrl']} (tensordict {t['tensordict']}, torch "
                f"{t['torch']}, {t['torch_threads']} threads), its own process with "
                f"{t['items']:,} items: ReplayBuffer with a RandomSampler; inserts are add() "
                f"and extend() of {params['rows']} rows, one window of each"
            )
    return {
        "title": "Baselines: echo's zstd-1 table, a Python zstandard loop and TorchRL's "
        "CompressedListStorage (mixed items, batches of 256, the same consumers)",
        "columns": cols,
        "rows": rows,
        "notes": [
            f"RSS bytes/item measured at the items held, scaled linearly to {full:,}; rates: "
            f"echo and the zstandard loop with {params['items']:,} items each",
            *notes,
        ],
    }


WIRE_PATHS = (
    ("direct", "direct loopback"),
    ("relay-limited", "relay at {rate:g} Mb/s"),
    ("relay-unlimited", "relay, no limit"),
)


def _wire_table(results: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    cols = ["echo", "path", "raw blast MB/s", "without: samples/s", "without: raw MB/s"]
    cols += ["with: samples/s", "with / without", "worker CPU us/sample (without)"]
    rows = c.failed_rows(results, len(cols))
    notes: list[str] = []
    for side, res in _sides(results):
        w = res["wire"]
        blasts = w.get("blast_mb_per_s", {})
        by = {(r["path"], r["wire_compression"]): r for r in w.get("rounds", [])}
        for path, label in WIRE_PATHS:
            off, on = by.get((path, False), {}), by.get((path, True))
            r = _wire_ratio(w, path)
            rows.append(
                [
                    side,
                    label.format(rate=w["rate_mbit"]),
                    c.num(blasts.get(path)),
                    c.num(off.get("samples_per_s")),
                    c.num(off.get("mb_per_s_raw")),
                    NOT_AVAILABLE if on is None else c.num(on.get("samples_per_s")),
                    "-" if r is None else f"{r:.2f}x",
                    c.num(off.get("worker_cpu_us"), ".1f"),
                ]
            )
        if not w["with_available"]:
            notes.append(
                f"{side}: this echo's TcpClient has no wire_compression keyword: measured "
                "without wire compression only"
            )
        failed = [r for r in w.get("rounds", []) if not r.get("correct")]
        if failed:
            notes.append(
                f"{side}: failed rounds: "
                + "; ".join(f"{r['path']}: {r.get('error')}" for r in failed)[:300]
            )
    return {
        "title": f"Wire: {params['workers']} TcpClient worker processes sending one step per "
        "send() to a zstd-1 table, directly and through a Python relay on loopback",
        "columns": cols,
        "rows": rows,
        "notes": [
            "raw blast: one connection sending 1 MiB chunks through the same path, the path's "
            "own ceiling (the relay is Python threads: its unlimited ceiling shows whether a "
            "limit is the link's or the relay's); raw MB/s: samples/s x 28,237 bytes",
            *notes,
        ],
    }


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    if not _sides(results):  # nothing measured: the reason (or the error) once
        return [_targets_table(results, params)]
    return [
        _targets_table(results, params),
        _memory_table(results, params),
        _rates_table(results, params),
        _baselines_table(results, params),
        _wire_table(results, params),
    ]


def main(argv: list[str]) -> int:
    if argv[:1] == ["case"] and len(argv) == 3:
        print(json.dumps(case_main(json.loads(argv[1]), json.loads(argv[2]))), flush=True)
        return 0
    if argv[:1] == ["relay"] and len(argv) == 4:
        return relay_main(int(argv[1]), float(argv[2]), float(argv[3]))
    if argv[:1] == ["worker"] and len(argv) == 2:
        return worker_main(json.loads(argv[1]))
    print("usage: python -m benches.suites.compression case|relay|worker ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
