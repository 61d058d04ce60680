"""The data of the sequence-table benchmark (:mod:`benches.suites.sequence_tables`): the two
step kinds and their sizes, the timing summaries (p50/p99 and bandwidth), the frame pool and
the seeded episodes every stream walks through, and the flat arrays (and their checks) that
the numpy and memcpy baselines gather windows from. numpy at import time.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np

from benches import common as h

ID_STRIDE = 10**7  # step id = stream * ID_STRIDE + t
HASH = np.uint64(2654435761)  # Knuth's multiplicative hash: id -> frame of the pool
# Each step kind: (leaf name, shape, dtype), in the order echo flattens a dict (sorted keys).
KINDS: dict[str, list[tuple[str, tuple[int, ...], str]]] = {
    "atari": [("action", (), "int64"), ("discount", (), "float32"), ("obs", (84, 84), "uint8"),
              ("reward", (), "float32")],
    "small": [("action", (), "int64"), ("discount", (), "float32"), ("obs", (60,), "float32"),
              ("reward", (), "float32")],
}  # fmt: skip
SAMPLE_TIMEOUT_S = 10.0
FILL_ROWS = 8192  # rows per chunk when filling flat arrays
MAX_BATCHES = 100_000
MAX_STEPS = 50_000_000
log = h.logger("bench_sequence")


def step_bytes(kind: str) -> int:
    return sum(int(np.prod(shape)) * np.dtype(dt).itemsize for _, shape, dt in KINDS[kind])


def example(kind: str) -> dict[str, np.ndarray]:
    return {name: np.zeros(shape, dt) for name, shape, dt in KINDS[kind]}


def rss_bytes() -> int:
    return h.proc_kib("/proc/self/status", "VmRSS").get("VmRSS", 0) * 1024


def percentiles_ms(ns: np.ndarray) -> dict[str, float]:
    ms = ns / 1e6
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
        "min_ms": float(ms.min()),
    }


def timing(ns: list[int], nbytes: int) -> dict[str, Any]:
    """p50/p99 of per-batch times and the bandwidth: ``nbytes`` per batch at the median."""
    arr = np.asarray(ns, np.float64)
    out: dict[str, Any] = {"batches": len(ns), "bytes_per_batch": nbytes}
    if len(ns) == 0:
        return out
    out.update(percentiles_ms(arr))
    out["gb_per_s"] = nbytes / (out["p50_ms"] * 1e-3) / 1e9
    out["gb_per_s_mean"] = nbytes / (out["mean_ms"] * 1e-3) / 1e9
    return out


# --------------------------------------------------------------------------- the data


class Frames:
    """Step contents: row ``i`` of a leaf for step id ``ids[i]``; ``obs`` is a pool frame
    picked by hashing the id, its first 8 bytes overwritten with the id."""

    def __init__(self, kind: str, pool: int, seed: int) -> None:
        self.kind = kind
        rng = np.random.default_rng([seed, 1])
        obs = next(x for x in KINDS[kind] if x[0] == "obs")
        self.obs_shape, self.obs_dtype = obs[1], np.dtype(obs[2])
        nbytes = int(np.prod(self.obs_shape)) * self.obs_dtype.itemsize
        raw = rng.integers(0, 256, (pool, nbytes), dtype=np.uint8)
        if self.obs_dtype.kind == "f":  # no NaN payloads: finite floats in [0, 1)
            raw = rng.random((pool, *self.obs_shape), dtype=np.float32).view(np.uint8)
            raw = raw.reshape(pool, nbytes)
        self.pool = raw
        self.obs_bytes = nbytes

    def frame_index(self, ids: np.ndarray) -> np.ndarray:
        return ((ids.astype(np.uint64) * HASH) % np.uint64(len(self.pool))).astype(np.intp)

    def rows(self, ids: np.ndarray, ends: np.ndarray | None = None) -> dict[str, np.ndarray]:
        n = len(ids)
        obs = self.pool[self.frame_index(ids)]  # (n, obs_bytes) copy
        obs[:, :8] = ids.astype("<i8").view(np.uint8).reshape(n, 8)
        discount = np.ones(n, np.float32) if ends is None else (~ends).astype(np.float32)
        return {
            "action": ids.astype(np.int64),
            "discount": discount,
            "obs": obs.view(self.obs_dtype).reshape(n, *self.obs_shape),
            "reward": (ids % 1000).astype(np.float32),
        }

    def expected_obs(self, step_id: int) -> np.ndarray:
        """The bytes ``obs`` of step ``step_id`` holds."""
        row = self.pool[self.frame_index(np.array([step_id]))[0]].copy()
        row[:8] = np.array([step_id], "<i8").view(np.uint8)
        return row


class Episodes:
    """Each stream's episodes: lengths drawn from the stream's own seeded RNG, so every
    layout (interleaved for echo, contiguous for numpy) holds the same episodes."""

    def __init__(self, streams: int, min_len: int, max_len: int, seed: int) -> None:
        self.rngs = [np.random.default_rng([seed, 2, k]) for k in range(streams)]
        self.min_len, self.max_len = min_len, max_len
        self.starts: list[list[int]] = [[0] for _ in range(streams)]  # episode start t's
        self.ends: list[list[int]] = [[] for _ in range(streams)]  # ended episodes' end t's
        self.next_end = [self._draw(k) for k in range(streams)]

    def _draw(self, k: int) -> int:
        return self.starts[k][-1] + int(self.rngs[k].integers(self.min_len, self.max_len + 1))

    def ends_at(self, k: int, t: int) -> bool:
        """Whether step ``t`` of stream ``k`` (steps asked for in order) ends its episode."""
        if t + 1 < self.next_end[k]:
            return False
        self.ends[k].append(t + 1)
        self.starts[k].append(t + 1)
        self.next_end[k] = self._draw(k)
        return True

    def episode_of(self, k: int, t: int) -> tuple[int, int | None]:
        """(start, end or None while open) of the episode holding step ``t`` of stream ``k``."""
        e = bisect.bisect_right(self.starts[k], t) - 1
        return self.starts[k][e], (self.ends[k][e] if e < len(self.ends[k]) else None)

    def full_window_starts(self, k: int, steps: int, length: int, period: int) -> np.ndarray:
        """The in-stream step of every full window of stream ``k``'s first ``steps`` steps."""
        out: list[np.ndarray] = []
        for s, e in zip(self.starts[k], [*self.ends[k], steps], strict=False):
            e = min(e, steps)
            if e - s >= length:
                out.append(np.arange(s, e - length + 1, period))
        return np.concatenate(out) if out else np.zeros(0, np.int64)


def touch(arr: Any) -> int:
    """The consumer: reads one byte of every 64 of ``arr`` (every cache line of it)."""
    flat = np.asarray(arr).reshape(-1).view(np.uint8)
    return int(flat[::64].sum(dtype=np.uint64))


def flat_chunks(
    kind: str, steps: int, streams: int, frames: Frames
) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """Every stream's first ``steps // streams`` steps, stream after stream (the layout of
    numpy and TorchRL storage), as ``(first flat row, rows)`` chunks of ``FILL_ROWS``."""
    per = steps // streams
    for k in range(streams):
        for lo in range(0, per, FILL_ROWS):
            hi = min(per, lo + FILL_ROWS)
            yield k * per + lo, frames.rows(k * ID_STRIDE + np.arange(lo, hi, dtype=np.int64))


def flat_tables(kind: str, steps: int, streams: int, frames: Frames) -> dict[str, np.ndarray]:
    """``flat_chunks`` in one array per leaf."""
    n = (steps // streams) * streams
    out = {name: np.empty((n, *shape), dt) for name, shape, dt in KINDS[kind]}
    for lo, rows in flat_chunks(kind, steps, streams, frames):
        for name, arr in out.items():
            arr[lo : lo + len(rows[name])] = rows[name]
    return out


def flat_window_starts(
    steps: int, streams: int, episodes: Episodes, length: int, period: int
) -> np.ndarray:
    per = steps // streams
    parts = [k * per + episodes.full_window_starts(k, per, length, period) for k in range(streams)]
    return np.concatenate(parts).astype(np.intp)


def flat_episode_ids(steps: int, streams: int, episodes: Episodes) -> np.ndarray:
    """An episode id per flat step (TorchRL's ``traj_key``)."""
    per = steps // streams
    out = np.empty(per * streams, np.int64)
    next_id = 0
    for k in range(streams):
        bounds = [s for s in episodes.starts[k] if s < per] + [per]
        for s, e in itertools.pairwise(bounds):
            out[k * per + s : k * per + e] = next_id
            next_id += 1
    return out


def check_flat_windows(action: np.ndarray, episodes: Episodes, length: int) -> bool:
    """Rows of ``action`` (batch, length) are consecutive step ids of one episode."""
    a = np.asarray(action).reshape(-1, length)
    if not bool(np.all(np.diff(a, axis=1) == 1)):
        return False
    for first in a[:, 0].tolist():
        k, t = divmod(int(first), ID_STRIDE)
        _, end = episodes.episode_of(k, t)
        if end is not None and t + length > end:
            return False
    return True


def obs_stamps(obs: np.ndarray) -> np.ndarray:
    """The step id stamped over the first 8 bytes of each step's ``obs``: ``obs`` is
    ``(batch, length, ...)``, the result ``(batch, length)`` int64."""
    o = np.ascontiguousarray(obs)
    b = o.reshape(o.shape[0], o.shape[1], -1).view(np.uint8)
    return np.ascontiguousarray(b[..., :8]).view("<i8")[..., 0]
