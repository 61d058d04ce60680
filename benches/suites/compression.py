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
part's server runs in the suite's own process, its relay and workers in child processes
(:mod:`benches.suites.compression_wire`):

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

This module holds the parameters, the child cases and ``measure``; what it shares with the
``sequence-compression`` suite (frames, items, codecs, the timed windows) is in
:mod:`benches.suites.compression_common`, the wire part in
:mod:`benches.suites.compression_wire`, the targets and tables in
:mod:`benches.suites.compression_tables`.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time
from typing import Any

from benches import common as c
from benches.suites import compression_common as cc
from benches.suites.compression_common import (
    BATCH,
    CODEC_LABELS,
    CODECS,
    GAME_NAMES,
    GAMES,
    codec,
    example,
    pool,
    timed,
)
from benches.suites.compression_tables import (
    NOT_AVAILABLE,
    PY_ZSTD,
    WIRE_PATHS,
    tables,
    targets,
)
from benches.suites.compression_wire import wire_compression_available, wire_limit, wire_part

# What the tests and sequence_compression read here.
__all__ = [
    "CODECS",
    "CODEC_LABELS",
    "GAME_NAMES",
    "NOT_AVAILABLE",
    "WIRE_PATHS",
    "limit_s",
    "measure",
    "parameters",
    "tables",
    "targets",
    "wire_compression_available",
]

CONSUMERS = ("copy", "sum")
INSERTS = ("submit", "submit_batch")


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
    full, raw = cc.memory_sizes(params, "items")
    cases = cc.memory_cases(params, "items")
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


def limit_s(params: dict[str, Any]) -> float:
    cases = [{"kind": "memory", **m} for m in _memory_cases(params)]
    cases += [{"kind": k} for k in ("throughput", "zstandard")]
    cases += [{"kind": "torchrl"}] if params.get("torchrl") else []
    return 120.0 + sum(_case_limit(k, params) for k in cases) + wire_limit(params)


def _fill(server: Any, obs: Any, items: int, chunk: int) -> float:
    """``submit_batch`` of ``chunk`` rows until ``items`` are in; the seconds it took."""
    t0 = time.perf_counter()
    done, start = 0, 0
    for _ in range(items + 1):  # each call inserts at least one
        if done >= items:
            break
        n = min(chunk, items - done, len(obs) - start)
        server.submit_batch(cc.rows_at(obs, start, n))
        done += n
        start = (start + n) % len(obs)
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- children


def _memory_case(params: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    import echo

    obs = pool(params, case["game"])
    items = int(case["items"])
    server, before, after, fill_s = cc.rss_around(
        lambda: echo.Server(
            example(),
            BATCH,
            sampler=echo.Uniform(),
            max_size=items,
            seed=1,
            compress=codec(case["codec"]),
        ),
        lambda server: _fill(server, obs, items, int(params["chunk"])),
    )
    st = server.stats()
    correct = st.store_size == items
    for _ in range(2):
        got = server.sample(timeout=30)
        correct = (
            correct and got is not None and cc.check_obs(got.batch["obs"], got.batch["action"], obs)
        )
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
            self.submit(cc.one_item(obs, i % len(obs)))
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
    singles = [cc.one_item(obs, i) for i in range(len(obs))]
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
        t.submit_batch(cc.rows_at(obs, starts[nxt[0] % len(starts)], rows))
        nxt[0] += 1

    ops = {"sample/copy": (copy, 1), "sample/sum": (total, 1)}
    ops |= {"insert/submit": (one, 1), "insert/submit_batch": (many, rows)}
    runs: dict[str, list[float]] = {}
    own: dict[str, list[float]] = {}
    others: dict[str, list[float]] = {}
    for op, fn, per_call, name in cc.rotation(ops, list(tables), int(params["repeats"])):
        table, key = tables[name], f"{op}/{name}"
        batch = table.sample()
        out["correct"] = out["correct"] and cc.check_obs(batch["obs"], batch["action"], obs)
        m0, c0, w0 = machine_busy(), time.process_time(), time.perf_counter()
        runs.setdefault(key, []).append(timed(lambda t=table, f=fn: f(t), seconds, per_call))
        m1, c1, w1 = machine_busy(), time.process_time(), time.perf_counter()
        own.setdefault(key, []).append((c1 - c0) / (w1 - w0))
        if m0 is not None and m1 is not None and m1[0] > m0[0]:
            busy = (os.cpu_count() or 1) * (1 - (m1[1] - m0[1]) / (m1[0] - m0[0]))
            others.setdefault(key, []).append(max(0.0, busy - own[key][-1]))
    for table in tables.values():
        batch = table.sample()
        out["correct"] = out["correct"] and cc.check_obs(batch["obs"], batch["action"], obs)
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
    table.submit(
        cc.one_item(obs, 0)
    )  # the codec contexts' buffers, before the baseline: not per item
    table.pos, table.size = 0, 0
    c.malloc_trim()
    before = c.settle_rss(max_s=5.0)
    fill_s = table.fill(obs, n, int(params["chunk"]))
    c.malloc_trim()
    after = c.settle_rss(max_s=10.0)
    correct = all(
        cc.check_obs(b["obs"], b["action"], obs) for b in (table.sample(), table.sample())
    )
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
        return cc.check_obs(s["obs"].numpy(), s["action"].numpy(), obs_np)

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


def run_case(python: str, case: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """One case in a child process of ``python``, bounded by its limit (:func:`_case_limit`)."""
    return cc.run_case(
        python, case, params, _case_limit(case, params), "benches.suites.compression"
    )


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


# --------------------------------------------------------------------------- measure


def measure(params: dict[str, Any]) -> dict[str, Any]:
    return cc.measure_frames(params, limit_s(params), _measure)


def _measure(params: dict[str, Any]) -> dict[str, Any]:
    obs = pool(params, "mixed")  # generates the frames into the cache once, here
    out: dict[str, Any] = {
        "loadavg_start": c.loadavg(),
        "pool_per_game": len(obs) // len(params["games"]),
        "item_raw_bytes": sum(x.nbytes for x in cc.one_item(obs, 0).values()),
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
    out["wire"] = wire_part(params)
    out["loadavg_end"] = c.loadavg()
    parts = [*out["memory"], out["throughput"], out["wire"]]
    parts += [out[k] for k in ("zstandard", "torchrl") if "skipped" not in out[k]]
    out["correct"] = all("error" not in p and p.get("correct") for p in parts)
    out["targets"] = targets(out, params)
    return out


def main(argv: list[str]) -> int:
    if cc.answer_case(argv, case_main):
        return 0
    print("usage: python -m benches.suites.compression case PARAMS CASE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
