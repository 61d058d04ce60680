"""What the two compression suites share: :mod:`benches.suites.compression` (replay tables)
and :mod:`benches.suites.sequence_compression` (sequence tables) measure compressed tables on
the same real Atari steps, against the same uncompressed table, the same way.

Here: the games and codecs, the targets both hold the tables to, the Atari frames their items
cycle through (:mod:`benches.atari_frames`) and the item layout, its rows and its bit-exact
check, the codec setup of a ``Server``, the timed window and the rotation of the tables
through windows, RSS around a table's fill, the child process that runs one case (bounded,
its process group ended past its limit), the ratios of paired windows, and the pieces the
suites' tables share. Standard library only at import time (numpy and echo inside).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benches import common as c

GAMES = ("pong", "breakout", "ms_pacman")
GAME_NAMES = {"pong": "Pong", "breakout": "Breakout", "ms_pacman": "MsPacman", "mixed": "mixed"}
CODECS = ("none", "zstd-1", "lz4")
CODEC_LABELS = {"none": "uncompressed", "zstd-1": "zstd-1", "lz4": "LZ4"}
COMPRESSED = ("zstd-1", "lz4")
BATCH = 256
MAX_CALLS = 10_000_000  # bound on the calls of one timed window (its seconds come first)

MEMORY_TARGET = 1 / 8  # compressed RSS at most this fraction of uncompressed
SAMPLE_TARGET = 0.5  # batches/s at least this fraction of uncompressed
INSERT_TARGET = 0.5


# --------------------------------------------------------------------------- frames, items


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


def games_of(params: dict[str, Any], game: str) -> list[str]:
    """The games a pool holds: one, or every game one after the other (``mixed``)."""
    return list(params["games"]) if game == "mixed" else [game]


def pool(
    params: dict[str, Any],
    game: str,
    limit: int | None = None,
    frames: dict[str, dict[str, Any]] | None = None,
) -> Any:
    """The ``(P, 84, 84, 4) uint8`` observations items cycle through: one game's, or every
    game's one after the other (``mixed``); the first ``limit`` of each game when given.
    ``frames``: :func:`load_frames`'s, where the caller has them already."""
    import numpy as np

    from benches import atari_frames as af

    frames = load_frames(params) if frames is None else frames
    games = games_of(params, game)
    parts = [af.observations(frames[g]["frames"], frames[g]["episode_start"]) for g in games]
    return np.ascontiguousarray(np.concatenate([p[:limit] for p in parts]))


def example() -> dict[str, Any]:
    """One DQN Atari step: the item (or sequence step) of every table here."""
    import numpy as np

    return {
        "obs": np.zeros((84, 84, 4), np.uint8),
        "action": np.zeros((), np.int64),
        "reward": np.zeros((), np.float32),
        "done": np.zeros((), np.bool_),
    }


def rows_at(obs: Any, start: int, n: int) -> dict[str, Any]:
    """``n`` items from pool row ``start`` on (no wrap: the caller keeps it in range);
    ``action`` is each item's pool row."""
    import numpy as np

    index = np.arange(start, start + n, dtype=np.int64)
    return {
        "obs": obs[start : start + n],
        "action": index,
        "reward": (index % 7).astype(np.float32),
        "done": index % 500 == 499,
    }


def one_item(obs: Any, i: int) -> dict[str, Any]:
    """Pool row ``i`` as one item (``action``: ``i``)."""
    import numpy as np

    return {
        "obs": obs[i],
        "action": np.int64(i),
        "reward": np.float32(i % 7),
        "done": np.bool_(i % 500 == 499),
    }


def check_obs(batch_obs: Any, actions: Any, obs: Any) -> bool:
    """Every row of a batch is the pool's item its ``action`` names, bit-exact."""
    import numpy as np

    idx = np.asarray(actions, np.int64)
    if idx.min() < 0 or idx.max() >= len(obs):
        return False
    return bool(np.array_equal(np.asarray(batch_obs), obs[idx]))


def codec(name: str) -> Any:
    """The ``compress=`` argument of a ``Server`` for a codec of :data:`CODECS`."""
    import echo

    return {"none": None, "zstd-1": {"obs": echo.Zstd(1)}, "lz4": {"obs": echo.Lz4()}}[name]


# --------------------------------------------------------------------------- measuring


def timed(fn: Any, seconds: float, per_call: int = 1) -> float:
    """Calls ``fn`` (two untimed first) for ``seconds`` (at most ``MAX_CALLS``); per second."""
    calls, elapsed = c.timed_loop(fn, seconds, MAX_CALLS)
    return calls * per_call / elapsed


def rss_around(
    build: Callable[[], Any], fill: Callable[[Any], float]
) -> tuple[Any, float, float, float]:
    """Builds a table and fills it between two settled RSS readings (``malloc_trim`` before
    each, so what stays is held, not cached); (the table, RSS before and after in MiB, the
    fill's seconds)."""
    c.malloc_trim()
    before = c.settle_rss(max_s=5.0)
    table = build()
    fill_s = fill(table)
    c.malloc_trim()
    after = c.settle_rss(max_s=10.0)
    return table, before, after, fill_s


def rotation(
    ops: dict[str, tuple[Any, int]], names: list[str], repeats: int
) -> Iterator[tuple[str, Any, int, str]]:
    """(operation, its function, items per call, table) of every window: per repeat and
    operation every table back to back, the order rotating from repeat to repeat, so that a
    busy moment of a shared machine hits the tables a ratio compares."""
    for rep in range(repeats):
        for op, (fn, per_call) in ops.items():
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                yield op, fn, per_call, name


def paired_ratios(th: dict[str, Any], op: str, codec: str) -> list[float]:
    """Per repeat, ``codec``'s rate over the uncompressed table's, from windows run back to
    back (paired, so a busy moment of a shared machine mostly cancels)."""
    runs = th.get("runs", {})
    pairs = zip(runs.get(f"{op}/{codec}", []), runs.get(f"{op}/none", []), strict=False)
    return [a / b for a, b in pairs if b > 0]


def median_or_none(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def memory_sizes(params: dict[str, Any], size: str) -> tuple[int, int]:
    """(``memory_SIZE``, ``memory_raw_SIZE``): the compressed tables' size and the smaller
    one the uncompressed table is measured at; ``size`` is ``items`` or ``steps``."""
    return int(params[f"memory_{size}"]), int(params[f"memory_raw_{size}"])


def memory_cases(params: dict[str, Any], size: str) -> list[dict[str, Any]]:
    """The memory cases both suites run, per game and mixed: uncompressed at the raw size,
    zstd-1 at the full one (:func:`memory_sizes`)."""
    full, raw = memory_sizes(params, size)
    cases = []
    for game in [*params["games"], "mixed"]:
        cases.append({"game": game, "codec": "none", size: raw})
        cases.append({"game": game, "codec": "zstd-1", size: full})
    return cases


def memory_pairs(
    res: dict[str, Any], params: dict[str, Any], size: str
) -> Iterator[tuple[str, str, dict[str, Any], dict[str, Any] | None]]:
    """(game, codec, the compressed case at the full size, the uncompressed one at the raw
    size or None) per game (and mixed) and compressed codec that ``res["memory"]`` has."""
    full, raw = memory_sizes(params, size)
    for game in [*params["games"], "mixed"]:
        by = {
            (m["codec"], m[size]): m
            for m in res["memory"]
            if m["game"] == game and "error" not in m
        }
        plain = by.get(("none", raw))
        for name in COMPRESSED:
            got = by.get((name, full))
            if got is not None:
                yield game, name, got, plain


# --------------------------------------------------------------------------- child cases


def measure_frames(
    params: dict[str, Any], limit: float, run: Callable[[dict[str, Any]], dict[str, Any]]
) -> dict[str, Any]:
    """A suite's ``measure``: ``run(params)`` under a watchdog of ``limit`` seconds, or,
    without Atari frames to measure on, why not (``{"skipped": ..., "correct": True}``)."""

    def go() -> dict[str, Any]:
        why = why_no_frames(params)
        if why is not None:
            return {"skipped": why, "correct": True}
        return run(params)

    return c.under_watchdog(limit, go)


def run_case(
    python: str, case: dict[str, Any], params: dict[str, Any], limit: float, module: str
) -> dict[str, Any]:
    """Runs one case in a child process of ``python`` (``module``'s ``case`` command, from
    the repository root), bounded by ``limit`` seconds; its result, or ``{"error": ...}``."""
    cmd = [python, "-m", module, "case", json.dumps(params)]
    cmd.append(json.dumps(case))
    t0 = time.monotonic()
    done = c.run_group(cmd, limit)
    if done is None:
        return {"error": f"{case['kind']}: over its {limit:.0f} s limit"}
    rc, out, err = done
    what = " ".join(str(case.get(k, "")) for k in ("kind", "game", "codec", "items"))
    print(
        f"{module.rsplit('.', 1)[-1]}: {what}: {time.monotonic() - t0:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    try:
        doc: dict[str, Any] = c.last_json_line(out)
    except ValueError:
        return {"error": f"{case['kind']}: exit status {rc}: {err.strip()[-400:]}"}
    return doc


def answer_case(
    argv: list[str], case_main: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]
) -> bool:
    """A child's ``case PARAMS CASE`` command line: prints ``case_main``'s result as JSON
    and says True; False for any other command line."""
    if argv[:1] == ["case"] and len(argv) == 3:
        print(json.dumps(case_main(json.loads(argv[1]), json.loads(argv[2]))), flush=True)
        return True
    return False


# --------------------------------------------------------------------------- tables


def sides(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The sides that measured something (failed and skipped ones are rows of their own)."""
    return [(s, r) for s, r in results.items() if "error" not in r and "skipped" not in r]


def suite_tables(
    results: dict[str, Any],
    params: dict[str, Any],
    targets_table: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]],
    *others: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]],
) -> list[dict[str, Any]]:
    """A suite's ``tables``: the targets table, then ``others``; only the targets table
    (which names the reason or the error once) when no side measured anything."""
    if not sides(results):
        return [targets_table(results, params)]
    return [table(results, params) for table in (targets_table, *others)]


def unmeasured_rows(results: dict[str, Any], width: int) -> list[list[str]]:
    """A row per side that failed (its error) or skipped (its reason), ``width`` cells."""
    rows = c.failed_rows(results, width)
    for side, res in results.items():
        if "skipped" in res:
            rows.append([side, f"skipped: {res['skipped']}", *["-"] * (width - 2)])
    return rows
