"""Compressed sequence tables: what ``Server(sequence=Sequence(80, period=40),
compress={"obs": echo.Zstd(1)})`` costs and saves on real Atari steps, against the same table
uncompressed, with the compressed-observations issue's targets.

A step is one DQN Atari step, ``{"obs": u8[84,84,4], "action": i64[], "reward": f32[],
"done": bool[]}`` (28,237 bytes raw), the observations stacks of 4 consecutive frames from
seeded random play of Pong, Breakout and MsPacman (``benches/atari_frames.py``, the pool of
the compression suite, :mod:`benches.suites.compression_common`, which holds what the two
compression suites share). The steps come from a vector environment of ``streams``
streams (``submit_batch``, one row per stream): stream ``k`` walks through the pool in order
from its own offset and ends its episode where the pool's episode ends, so every chunk the
table compresses holds consecutive steps of one episode, as in a real run. ``action`` holds
the step's pool index: every batch that is checked is compared, step by step, with the pool
(bit-exact or ``correct`` is False). Windows of 80 steps every 40 (R2D2), ``Uniform()``.

Each part runs in child processes (this file), bounded by a time limit:

1. **memory**: per game and mixed, ``VmRSS`` after filling a table, minus ``VmRSS`` before
   it was built (``malloc_trim`` and a settled reading both times): zstd-1 at
   ``memory_steps`` steps (LZ4 too, mixed), uncompressed at ``memory_raw_steps`` (1e6 raw
   steps are 28 GB, more than a 24 GiB machine has) scaled linearly, as the compression suite
   does. Also ``stats()``: stored and raw bytes, ``compression_ratio``.
2. **throughput** (mixed): one process holds tables of ``steps`` steps (uncompressed, zstd-1,
   LZ4, batches of ``batch_size`` windows) and times windows of ``seconds``: ``sample()``
   batches/s with a consumer that copies every batch's ``obs`` into a preallocated array,
   and steps/s into the full table (each step evicts, a long run's steady state) with
   ``submit`` of one stream's step and ``submit_batch`` of one step per stream. Per repeat
   and operation the tables run back to back in a rotating order; a ratio is the median
   over repeats of adjacent windows' ratios.

Loopback only (none is used); every loop is bounded in count and time. Without ale-py (the
``bench`` extra) and no cached frames it measures nothing and its record says why. Run:
``python -m benches sequence-compression [--quick]``.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from benches import common as c
from benches.suites import compression_common as cc

CODECS = cc.CODECS
CODEC_LABELS = cc.CODEC_LABELS
OPS = ("sample/copy", "insert/submit", "insert/submit_batch")


def parameters(quick: bool) -> dict[str, Any]:
    common = {
        "games": list(cc.GAMES),
        "seed": 0,
        "fixture": None,
        "length": 80,
        "period": 40,
        "streams": 16,
        "batch_size": 32,
    }
    if quick:
        return {
            **common,
            "pool_steps": 400,
            "memory_steps": 20_000,
            "memory_raw_steps": 5_000,
            "steps": 5_000,
            "seconds": 0.3,
            "repeats": 1,
        }
    return {
        **common,
        "pool_steps": 3000,
        "memory_steps": 1_000_000,
        "memory_raw_steps": 100_000,
        "steps": 40_000,
        "seconds": 1.5,
        "repeats": 5,
    }


def _memory_cases(params: dict[str, Any]) -> list[dict[str, Any]]:
    cases = cc.memory_cases(params, "steps")
    cases.append({"game": "mixed", "codec": "lz4", "steps": cc.memory_sizes(params, "steps")[0]})
    return cases


def _case_limit(case: dict[str, Any], params: dict[str, Any]) -> float:
    if case["kind"] == "memory":
        return 60.0 + case["steps"] / 5_000
    windows = len(CODECS) * len(OPS) * int(params["repeats"])
    return (
        120.0
        + len(CODECS) * int(params["steps"]) / 2_000
        + 2 * windows * (float(params["seconds"]) + 1.0)
    )


def limit_s(params: dict[str, Any]) -> float:
    cases = [{"kind": "memory", **m} for m in _memory_cases(params)] + [{"kind": "throughput"}]
    return 60.0 + sum(_case_limit(k, params) for k in cases)


# --------------------------------------------------------------------------- the steps


class Pool:
    """One game's observations (or every game's, one after the other) and where their
    episodes start: what the vector environment replays."""

    def __init__(self, params: dict[str, Any], game: str) -> None:
        import numpy as np

        frames = cc.load_frames(params)
        self.obs = cc.pool(params, game, frames=frames)
        starts = [
            np.asarray(frames[g]["episode_start"], np.bool_).copy()
            for g in cc.games_of(params, game)
        ]
        for s in starts:
            s[0] = True  # a game's first step starts an episode
        self.episode_start = np.concatenate(starts)

    def __len__(self) -> int:
        return len(self.obs)


class VectorEnv:
    """``streams`` streams over a pool: stream ``k`` starts at pool row ``k * len / streams``
    and moves on by one row per step (wrapping); a step ends its episode when the next row
    starts one."""

    def __init__(self, pool: Pool, streams: int) -> None:
        import numpy as np

        self.pool, self.streams = pool, streams
        self.at = np.arange(streams, dtype=np.int64) * len(pool) // streams

    def rows(self) -> tuple[dict[str, Any], Any]:
        """Every stream's next step, as one batch of rows, and which rows end an episode."""
        import numpy as np

        n = len(self.pool)
        at = self.at
        ends = self.pool.episode_start[(at + 1) % n]
        rows = {
            "obs": self.pool.obs[at],
            "action": at.copy(),
            "reward": (at % 7).astype(np.float32),
            "done": ends,
        }
        self.at = (at + 1) % n
        return rows, ends

    def one(self, k: int) -> tuple[dict[str, Any], bool]:
        """Stream ``k``'s next step alone, and whether it ends an episode."""
        import numpy as np

        n = len(self.pool)
        at = int(self.at[k])
        end = bool(self.pool.episode_start[(at + 1) % n])
        self.at[k] = (at + 1) % n
        step = {
            "obs": self.pool.obs[at],
            "action": np.int64(at),
            "reward": np.float32(at % 7),
            "done": np.bool_(end),
        }
        return step, end


def _server(params: dict[str, Any], steps: int, codec: str) -> Any:
    import echo

    return echo.Server(
        cc.example(),
        int(params["batch_size"]),
        sampler=echo.Uniform(),
        max_size=steps,
        seed=3,
        sequence=echo.Sequence(int(params["length"]), period=int(params["period"])),
        compress=cc.codec(codec),
    )


def _fill(server: Any, env: VectorEnv, steps: int) -> float:
    """One step per stream per call until ``steps`` are in; the seconds it took."""
    t0 = time.perf_counter()
    for _ in range(steps // env.streams):
        rows, ends = env.rows()
        server.submit_batch(rows, end_episode=ends)
    return time.perf_counter() - t0


def _check(sample: Any, pool: Pool) -> bool:
    """Every real step of every window is the pool's row its ``action`` names, bit-exact."""
    import numpy as np

    mask = np.asarray(sample.mask)
    idx = np.asarray(sample.batch["action"])[mask]
    if not mask.any() or idx.min() < 0 or idx.max() >= len(pool):
        return False
    return bool(np.array_equal(np.asarray(sample.batch["obs"])[mask], pool.obs[idx]))


# --------------------------------------------------------------------------- children


def _memory_case(params: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    pool = Pool(params, case["game"])
    env = VectorEnv(pool, int(params["streams"]))
    steps = int(case["steps"])
    server, before, after, fill_s = cc.rss_around(
        lambda: _server(params, steps, case["codec"]), lambda server: _fill(server, env, steps)
    )
    st = server.stats()
    correct = st.steps_stored > 0
    for _ in range(2):
        got = server.sample(timeout=30)
        correct = correct and got is not None and _check(got, pool)
    server.close()
    return {
        **case,
        "pool": len(pool),
        "rss_before_mib": before,
        "rss_mib": after - before,
        "steps_stored": st.steps_stored,
        "stored_bytes": st.stored_bytes,
        "raw_bytes": st.raw_bytes,
        "compression_ratio": st.compression_ratio,
        "fill_steps_per_s": (steps // env.streams * env.streams) / fill_s,
        "correct": bool(correct),
    }


def _throughput_case(params: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    pool = Pool(params, "mixed")
    streams, steps, seconds = int(params["streams"]), int(params["steps"]), float(params["seconds"])
    envs = {name: VectorEnv(pool, streams) for name in CODECS}
    tables = {name: _server(params, steps, name) for name in CODECS}
    out: dict[str, Any] = {"steps": steps, "pool": len(pool), "correct": True}
    out["fill_steps_per_s"] = {n: steps / _fill(tables[n], envs[n], steps) for n in CODECS}
    out["compression_ratio"] = {n: tables[n].stats().compression_ratio for n in CODECS}
    length, batch = int(params["length"]), int(params["batch_size"])
    dst = np.empty((batch, length, *pool.obs.shape[1:]), np.uint8)
    turn = [0]

    def copy(name: str) -> None:
        np.copyto(dst, tables[name].sample(timeout=30).batch["obs"])

    def one(name: str) -> None:
        k = turn[0] % streams
        turn[0] += 1
        step, end = envs[name].one(k)
        tables[name].submit(step, stream=k, end_episode=end)

    def many(name: str) -> None:
        rows, ends = envs[name].rows()
        tables[name].submit_batch(rows, end_episode=ends)

    ops = {"sample/copy": (copy, 1), "insert/submit": (one, 1)}
    ops["insert/submit_batch"] = (many, streams)
    runs: dict[str, list[float]] = {}
    for op, fn, per_call, name in cc.rotation(ops, list(CODECS), int(params["repeats"])):
        got = tables[name].sample(timeout=30)
        out["correct"] = out["correct"] and got is not None and _check(got, pool)
        rate = cc.timed(lambda f=fn, n=name: f(n), seconds, per_call)
        runs.setdefault(f"{op}/{name}", []).append(rate)
    for table in tables.values():
        got = table.sample(timeout=30)
        out["correct"] = out["correct"] and got is not None and _check(got, pool)
        table.close()
    out["rates"] = {k: statistics.median(v) for k, v in runs.items()}
    out["runs"] = runs
    return out


def case_main(params: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    c.watchdog(_case_limit(case, params))
    if case["kind"] == "memory":
        return _memory_case(params, case)
    if case["kind"] == "throughput":
        return _throughput_case(params)
    raise ValueError(f"no case {case['kind']!r}")


def _run(case: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    limit = _case_limit(case, params)
    return cc.run_case(sys.executable, case, params, limit, "benches.suites.sequence_compression")


def measure(params: dict[str, Any]) -> dict[str, Any]:
    return cc.measure_frames(params, limit_s(params), _measure)


def _measure(params: dict[str, Any]) -> dict[str, Any]:
    pool = Pool(params, "mixed")  # generates the frames into the cache once, here
    out: dict[str, Any] = {
        "loadavg_start": c.loadavg(),
        "pool_per_game": len(pool) // len(params["games"]),
        "step_raw_bytes": pool.obs[0].nbytes + 8 + 4 + 1,
        "memory": [],
    }
    del pool
    for case in _memory_cases(params):
        out["memory"].append({**case, **_run({"kind": "memory", **case}, params)})
    out["throughput"] = _run({"kind": "throughput"}, params)
    out["loadavg_end"] = c.loadavg()
    parts = [*out["memory"], out["throughput"]]
    out["correct"] = all("error" not in p and p.get("correct") for p in parts)
    out["targets"] = targets(out, params)
    return out


# --------------------------------------------------------------------------- targets, tables


def _memory_summary(res: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    """Per game (and mixed): the compressed table's RSS at ``memory_steps`` against the
    uncompressed one's, scaled from ``memory_raw_steps``."""
    full, raw = cc.memory_sizes(params, "steps")
    rows = []
    for game, codec, got, plain in cc.memory_pairs(res, params, "steps"):
        if plain is None:
            continue
        scaled = plain["rss_mib"] * full / raw
        rows.append(
            {
                "game": game,
                "codec": codec,
                "rss_mib": got["rss_mib"],
                "raw_rss_mib": scaled,
                "fraction": got["rss_mib"] / scaled if scaled > 0 else None,
                "compression_ratio": got["compression_ratio"],
            }
        )
    return rows


def _ratio(rates: dict[str, float], op: str, codec: str) -> float | None:
    base = rates.get(f"{op}/none")
    got = rates.get(f"{op}/{codec}")
    return got / base if base and got is not None else None


def _adjacent_ratio(th: dict[str, Any], op: str, codec: str) -> float | None:
    """The median over repeats of the codec's window against the uncompressed one's."""
    ratios = cc.paired_ratios(th, op, codec)
    return statistics.median(ratios) if ratios else _ratio(th.get("rates", {}), op, codec)


def targets(res: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for row in _memory_summary(res, params):
        if row["codec"] != "zstd-1":
            continue
        out.append(
            {
                "target": f"RSS at {int(params['memory_steps']):,} steps, {row['game']}",
                "bound": f"<= {cc.MEMORY_TARGET:.3f} of uncompressed",
                "value": row["fraction"],
                "met": row["fraction"] is not None and row["fraction"] <= cc.MEMORY_TARGET,
            }
        )
    th = res.get("throughput", {})
    for op, bound in (
        ("sample/copy", cc.SAMPLE_TARGET),
        ("insert/submit", cc.INSERT_TARGET),
        ("insert/submit_batch", cc.INSERT_TARGET),
    ):
        value = _adjacent_ratio(th, op, "zstd-1") if "error" not in th else None
        out.append(
            {
                "target": f"{op}, zstd-1 against uncompressed",
                "bound": f">= {bound:.2f}x",
                "value": value,
                "met": value is not None and value >= bound,
            }
        )
    return out


def _fmt(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _targets_table(results: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    cols = ["echo", "target", "measured", "required", "met"]
    rows = cc.unmeasured_rows(results, len(cols))
    for side, res in cc.sides(results):
        rows += [
            [side, t["target"], _fmt(t["value"], ".3f"), t["bound"], "yes" if t["met"] else "NO"]
            for t in res.get("targets", [])
        ]
    return {
        "title": "Compressed sequence tables: the issue's targets",
        "columns": cols,
        "rows": rows,
        "notes": [
            f"Sequence({params['length']}, period={params['period']}), {params['streams']} "
            f"streams, batches of {params['batch_size']} windows. Memory: RSS of the zstd-1 "
            f"table at {int(params['memory_steps']):,} steps over the uncompressed one's at "
            f"{int(params['memory_raw_steps']):,} (scaled linearly); sampling and inserts: "
            f"tables of {int(params['steps']):,} mixed steps."
        ],
    }


def _memory_table(results: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    rows = [
        [
            side,
            cc.GAME_NAMES[r["game"]],
            CODEC_LABELS[r["codec"]],
            _fmt(r["raw_rss_mib"] / 1024, ",.2f"),
            _fmt(r["rss_mib"] / 1024, ",.3f"),
            _fmt(r["fraction"], ".4f"),
            _fmt(r["compression_ratio"], ",.1f"),
        ]
        for side, res in cc.sides(results)
        for r in _memory_summary(res, params)
    ]
    return {
        "title": f"Resident memory at {int(params['memory_steps']):,} steps",
        "columns": ["echo", "game", "codec", "uncompressed GiB", "GiB", "fraction", "ratio"],
        "rows": rows,
        "notes": [
            f"Uncompressed: measured at {int(params['memory_raw_steps']):,} steps, scaled "
            "linearly. Ratio: stats().compression_ratio (raw bytes over stored bytes; the "
            "chunks still filling, one per stream, are raw)."
        ],
    }


def _rates_table(results: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    units = {"sample/copy": "batches/s", "insert/submit": "steps/s"}
    units["insert/submit_batch"] = "steps/s"
    rows = c.failed_rows(results, 3 + len(CODECS))
    for side, res in cc.sides(results):
        th = res.get("throughput", {})
        if "error" in th:
            rows.append([side, str(th["error"])[:120], *["-"] * (1 + len(CODECS))])
            continue
        rates = th.get("rates", {})
        for op in OPS:
            row = [side, op, units[op]]
            for codec in CODECS:
                rate = rates.get(f"{op}/{codec}")
                cell = _fmt(rate, ",.1f" if op.startswith("sample") else ",.0f")
                if codec != "none" and rate is not None:
                    cell += f" ({_fmt(_adjacent_ratio(th, op, codec), '.2f')}x)"
                row.append(cell)
            rows.append(row)
    return {
        "title": f"Sampling and inserts, mixed, {int(params['steps']):,} steps",
        "columns": ["echo", "operation", "unit", *(CODEC_LABELS[k] for k in CODECS)],
        "rows": rows,
        "notes": [
            "sample/copy: sample() and np.copyto of every batch's obs into a preallocated "
            "array. Inserts go into the full table (each step evicts). Ratios: the median over "
            f"{params['repeats']} repeats of adjacent windows' ratios."
        ],
    }


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    return cc.suite_tables(results, params, _targets_table, _memory_table, _rates_table)


def main(argv: list[str]) -> int:
    if cc.answer_case(argv, case_main):
        return 0
    print("usage: python -m benches.suites.sequence_compression case PARAMS CASE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
