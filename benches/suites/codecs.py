"""Codecs on real Atari frames: compression ratio and one-core compress / decompress GB/s of
zstd (levels 1 and 3) and LZ4, per leaf, to choose what echo compresses and how (issue 25).

The frames are seeded random play of Pong, Breakout and MsPacman in the Arcade Learning
Environment, preprocessed the DQN way (``benches/atari_frames.py``: grayscale, max-pooled over
the last 2 of 4 frames, area-resized to 84x84, stacks of 4), generated once into
``target/atari-frames`` (``--set fixture=PATH`` reads a file that script wrote instead). Per
game, four uint8 leaves: one frame ``u8[84,84]``, one observation ``u8[84,84,4]`` (what a
replay table stores per item), and chunks of 16 consecutive frames and of 16 consecutive
observations of one episode stream (what a sequence table would compress together). Then the
leaves not to compress, from the same frames where they can be: the observation as float32
(``obs / 255``), float32 noise of the same byte size (a state vector), and small leaves under
4 KiB (a 1 KiB and a 3,360-byte crop of observations, a ``f32[17]`` state). And with
``nearest`` (the default), frames and 16-frame chunks of the same rollouts resized by
nearest neighbour instead of area averaging, zstd-1 only: the gray levels that averaging
adds cost compression, and the figures quoted in issue 25 match these.

The Python packages ``zstandard`` (libzstd) and ``lz4`` (liblz4, block format with the size
prepended) wrap the C libraries echo links (``zstd-safe`` and ``lz4-sys``): the same
formats and levels, but each call pays Python's overhead (about a microsecond) and allocates
its output, so small leaves look slower here than they would in Rust, and large ones about
the same. Throughput is raw (uncompressed) bytes per second, one thread, the median of
``passes`` timed passes over every item (repeated within a pass until it covers
``pass_mb``); ratio is raw bytes over compressed bytes of all items, and *worst* the lowest
ratio of one item. Every item is checked to round-trip bit-exact before timing.
Run: ``python -m benches codecs [--quick]``.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benches import common as c

CODECS = ("zstd-1", "zstd-3", "lz4")
ATARI_LEAVES = ("frame", "obs", "frames16", "obs16")
# The same rollouts resized nearest-neighbour instead of by area averaging (zstd-1 only):
# what the figures were measured on, by their match.
NEAREST_LEAVES = ("frame-nearest", "frames16-nearest")
OTHER_LEAVES = ("obs-f32", "noise-f32", "crop-3360", "crop-1k", "state-f32x17")
GAME_NAMES = {"pong": "Pong", "breakout": "Breakout", "ms_pacman": "MsPacman"}
MAX_REPS = 100_000  # bound on the repetitions of the item list within one timed pass


def parameters(quick: bool) -> dict[str, Any]:
    return {
        "games": ["pong", "breakout", "ms_pacman"],
        "steps": 400 if quick else 2000,
        "seed": 0,
        "chunk": 16,
        "passes": 3 if quick else 5,
        "pass_mb": 4 if quick else 16,
        "fixture": None,
        "nearest": True,
    }


def limit_s(params: dict[str, Any]) -> float:
    return 120.0 + 0.3 * int(params["steps"]) * int(params["passes"]) / 3


def _codecs() -> dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]]:
    import lz4.block
    import zstandard

    out: dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]] = {}
    for level in (1, 3):
        # threads=0 (the default): compression on the calling thread only. The frame header
        # carries the content size, which decompress() needs, as the Rust crate's bulk API.
        comp = zstandard.ZstdCompressor(level=level, write_content_size=True)
        out[f"zstd-{level}"] = (comp.compress, zstandard.ZstdDecompressor().decompress)
    # lz4_flex's compress_prepend_size / decompress_size_prepended: the block format with the
    # uncompressed size as a 4-byte little-endian prefix, which store_size=True writes.
    out["lz4"] = (
        lambda b: lz4.block.compress(b, mode="default", store_size=True),
        lz4.block.decompress,
    )
    return out


def _frames(params: dict[str, Any], resize: str = "area") -> dict[str, dict[str, Any]]:
    from benches import atari_frames as af

    if params.get("fixture"):
        games, _ = af.load(Path(params["fixture"]))
        return {g: games[g] for g in params["games"]}
    steps, seed = int(params["steps"]), int(params["seed"])
    return af.cached(steps, seed, params["games"], resize=resize)


def _chunks(starts: Any, chunk: int) -> list[tuple[int, int]]:
    """``[start, end)`` of consecutive chunks of ``chunk`` steps, none across an episode
    start (an episode's last steps that make no whole chunk are left out)."""
    import numpy as np

    bounds = [*np.flatnonzero(starts).tolist(), len(starts)]
    return [
        (s, s + chunk)
        for lo, hi in itertools.pairwise(bounds)
        for s in range(lo, hi - chunk + 1, chunk)
    ]


def _leaves(params: dict[str, Any]) -> dict[tuple[str, str], list[bytes]]:
    """``{(leaf, game): [item bytes, ...]}``; game ``all`` for the leaves pooled over games."""
    import numpy as np

    from benches import atari_frames as af

    chunk = int(params["chunk"])
    out: dict[tuple[str, str], list[bytes]] = {}
    pooled: dict[str, list[bytes]] = {name: [] for name in OTHER_LEAVES}
    rng = np.random.default_rng(int(params["seed"]))
    for game, arrays in _frames(params).items():
        frames, starts = arrays["frames"], arrays["episode_start"]
        obs = af.observations(frames, starts)
        spans = _chunks(starts, chunk)
        out[("frame", game)] = [f.tobytes() for f in frames]
        out[("obs", game)] = [o.tobytes() for o in obs]
        out[("frames16", game)] = [frames[a:b].tobytes() for a, b in spans]
        out[("obs16", game)] = [obs[a:b].tobytes() for a, b in spans]
        pooled["obs-f32"] += [(o.astype(np.float32) / 255.0).tobytes() for o in obs]
        noise = rng.standard_normal((len(obs), obs[0].size // 4), dtype=np.float32)
        pooled["noise-f32"] += [n.tobytes() for n in noise]
        pooled["crop-3360"] += [o[37:47].tobytes() for o in obs]  # 10 rows x 84 x 4
        pooled["crop-1k"] += [o[34:50, 34:50].tobytes() for o in obs]  # 16 x 16 x 4
        walk = np.cumsum(rng.standard_normal((len(obs), 17), dtype=np.float32), axis=0)
        pooled["state-f32x17"] += [s.tobytes() for s in walk]
    for name, items in pooled.items():
        out[(name, "all")] = items
    if params.get("nearest") and not params.get("fixture"):
        for game, arrays in _frames(params, "nearest").items():
            frames = arrays["frames"]
            out[("frame-nearest", game)] = [f.tobytes() for f in frames]
            spans = _chunks(arrays["episode_start"], chunk)
            out[("frames16-nearest", game)] = [frames[a:b].tobytes() for a, b in spans]
    return out


def _time_pass(fn: Callable[[bytes], bytes], items: list[bytes], reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        for x in items:
            fn(x)
    return time.perf_counter() - t0


def _one(
    comp: Callable[[bytes], bytes],
    decomp: Callable[[bytes], bytes],
    items: list[bytes],
    passes: int,
    pass_bytes: int,
) -> dict[str, Any]:
    packed = [comp(x) for x in items]
    correct = all(decomp(p) == x for p, x in zip(packed, items, strict=True))
    raw = sum(len(x) for x in items)
    stored = sum(len(p) for p in packed)
    reps = max(1, min(MAX_REPS, math.ceil(pass_bytes / raw)))
    calls = reps * len(items)
    t_comp = [_time_pass(comp, items, reps) for _ in range(passes)]
    t_decomp = [_time_pass(decomp, packed, reps) for _ in range(passes)]
    tc, td = c.median(t_comp), c.median(t_decomp)
    return {
        "items": len(items),
        "item_bytes": len(items[0]),
        "ratio": raw / stored,
        "worst_ratio": min(len(x) / len(p) for x, p in zip(items, packed, strict=True)),
        "compress_gb_s": reps * raw / tc / 1e9,
        "decompress_gb_s": reps * raw / td / 1e9,
        "compress_us": tc / calls * 1e6,
        "decompress_us": td / calls * 1e6,
        "correct": correct,
    }


def _copy_gb_s(items: list[bytes], passes: int, pass_bytes: int) -> float:
    """The reference: ``bytearray(x)`` of every item (an allocation and a memcpy per call)."""
    raw = sum(len(x) for x in items)
    reps = max(1, min(MAX_REPS, math.ceil(pass_bytes / raw)))
    return reps * raw / c.median([_time_pass(bytearray, items, reps) for _ in range(passes)]) / 1e9


def measure(params: dict[str, Any]) -> dict[str, Any]:
    return c.under_watchdog(limit_s(params), lambda: _measure(params))


def _measure(params: dict[str, Any]) -> dict[str, Any]:
    import lz4
    import zstandard

    passes, pass_bytes = int(params["passes"]), int(float(params["pass_mb"]) * c.MIB)
    leaves = _leaves(params)
    codecs = _codecs()
    rows: list[dict[str, Any]] = []
    for (leaf, game), items in leaves.items():
        if not items:
            continue
        for name in CODECS if leaf not in NEAREST_LEAVES else CODECS[:1]:
            r = _one(*codecs[name], items, passes, pass_bytes)
            rows.append({"leaf": leaf, "game": game, "codec": name, **r})
    obs_items = [x for (leaf, _), items in leaves.items() if leaf == "obs" for x in items]
    return {
        "zstandard": zstandard.__version__,
        "libzstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
        "lz4": lz4.__version__,
        "lz4_library": lz4.library_version_string(),
        "copy_obs_gb_s": _copy_gb_s(obs_items, passes, pass_bytes),
        "rows": rows,
        "correct": bool(rows) and all(r["correct"] for r in rows),
    }


LEAF_LABELS = {
    "frame": "frame u8[84,84]",
    "obs": "obs u8[84,84,4]",
    "frames16": "16 frames u8[16,84,84]",
    "obs16": "16 obs u8[16,84,84,4]",
    "frame-nearest": "frame u8[84,84], nearest resize",
    "frames16-nearest": "16 frames u8[16,84,84], nearest resize",
    "obs-f32": "obs / 255 f32[84,84,4]",
    "noise-f32": "noise f32[7056]",
    "crop-3360": "obs crop u8[10,84,4]",
    "crop-1k": "obs crop u8[16,16,4]",
    "state-f32x17": "state f32[17] (random walk)",
}


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    atari_cols = [
        "echo",
        "game",
        "leaf",
        "bytes",
        "codec",
        "ratio",
        "worst item",
        "compress GB/s",
        "decompress GB/s",
    ]
    other_cols = [
        "echo",
        "leaf",
        "bytes",
        "codec",
        "ratio",
        "compress GB/s",
        "decompress GB/s",
        "compress us",
        "decompress us",
    ]
    atari = c.failed_rows(results, len(atari_cols))
    other = c.failed_rows(results, len(other_cols))
    notes: list[str] = []
    for side, res in results.items():
        if "error" in res:
            continue
        order = {k: i for i, k in enumerate((*ATARI_LEAVES, *NEAREST_LEAVES, *OTHER_LEAVES))}
        games = {g: i for i, g in enumerate(params["games"])}
        for r in sorted(
            res["rows"],
            key=lambda r: (games.get(r["game"], -1), order[r["leaf"]], CODECS.index(r["codec"])),
        ):
            common = [c.num(r["item_bytes"], ",d"), r["codec"], f"{r['ratio']:.1f}x"]
            speeds = [c.num(r["compress_gb_s"], ".2f"), c.num(r["decompress_gb_s"], ".2f")]
            if r["game"] == "all":
                label = LEAF_LABELS.get(r["leaf"], r["leaf"])
                times = [c.num(r["compress_us"], ".2f"), c.num(r["decompress_us"], ".2f")]
                other.append([side, label, *common, *speeds, *times])
            else:
                game = GAME_NAMES.get(r["game"], r["game"])
                label = LEAF_LABELS.get(r["leaf"], r["leaf"])
                worst = f"{r['worst_ratio']:.1f}x"
                atari.append([side, game, label, *common, worst, *speeds])
        notes.append(
            f"{side}: zstandard {res['zstandard']} (libzstd {res['libzstd']}), lz4 "
            f"{res['lz4']} (liblz4 {res['lz4_library']}); bytearray() copy of the same "
            f"observations: {res['copy_obs_gb_s']:.2f} GB/s"
        )
    src = f"fixture {params['fixture']}" if params.get("fixture") else f"{params['steps']:,} steps"
    return [
        {
            "title": f"Atari frames ({src} of seeded random play per game): ratio and one-core "
            "GB/s of raw bytes per leaf",
            "columns": atari_cols,
            "rows": atari,
            "notes": [
                "16 frames / 16 obs: consecutive steps of one episode compressed together, as "
                "a sequence table's chunk would be; worst item: the lowest ratio of one item",
                "zstd-N: the `zstandard` package at level N; lz4: the `lz4` package's block "
                "format with the size prepended (the formats of the Rust `zstd` and "
                "`lz4_flex` crates); every item round-trips bit-exact",
                *notes,
            ],
        },
        {
            "title": "When not to compress: float32 leaves and small leaves (the same frames "
            "where they apply; all games pooled)",
            "columns": other_cols,
            "rows": other,
            "notes": [
                "us: microseconds per call, including Python's call overhead (about 1 us), "
                "which a Rust call would not pay"
            ],
        },
    ]
