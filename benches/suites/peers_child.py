"""One measurement of the ``peers`` suite (``benches/suites/peers.py``): one library, one row,
in a process of its own, run by that library's interpreter (echo's, or a peer's virtualenv)::

    PYTHON -m benches.suites.peers_child LIB ROW PARAMS_JSON --json OUT

from the repository root. LIB is ``echo`` (the echo this interpreter imports), ``cpprb``,
``rlox``, ``id-echo`` (the published 0.2.1, also imported as ``echo``) or ``memcpy`` (numpy
alone: the ceiling of the Atari gather). It imports numpy, ``benches.common`` (standard
library) and the library it measures, nothing else: echo only when LIB is echo or id-echo.
Writes ``{"lib", "row", "api", "versions", "rates", "best", "correct", ...}`` to OUT, or
``{"unsupported": why}`` where the library has no such feature.

The transition: obs ``float32[84]``, action ``int64``, reward ``float32``, done ``bool`` (each
library's nearest types: rlox stores actions as ``float32`` and done as two ``uint8`` flags,
plus a ``next_obs`` column). Atari: obs ``uint8[84, 84, 4]`` and the same scalars. Rows are
drawn in turn from a pool of distinct rows built before the clock starts, in the form each
library's insert takes (numpy rows and scalars, as an environment returns them). Every
sampled batch is read: one element of every array the library returns (``np.asarray`` first),
so a lazy view is paid for where there is one.

Each measurement repeats ``repeats`` times and reports every rate and the best: an insert
into a new table (first fill, the table built before the clock, its construction timed
apart), an insert into a full table (filled untimed through the library's fastest batch
path), or sampling from a full table. Every loop is bounded in count and time, and a
watchdog ends the process past ``child_timeout``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from benches import common as c

OBS = 84
FRAME = (84, 84, 4)
BATCH_ROWS = 64  # rows of one batch insert
CHUNK = 1024  # rows between two deadline checks of an insert loop

# row key: (label, unit, data, kind); kind: fill, steady, sample, prio, seq_fill, seq_sample
ROWS: dict[str, tuple[str, str, str, str]] = {
    "insert1_fill": ("single-row insert, first fill", "rows/s", "small", "fill"),
    "insert1_steady": ("single-row insert, steady (full, wrapping)", "rows/s", "small", "steady"),
    "insert64_fill": ("64-row insert, first fill", "rows/s", "small", "fill"),
    "insert64_steady": ("64-row insert, steady (full, wrapping)", "rows/s", "small", "steady"),
    "sample_uniform": ("uniform sample of 256", "batches/s", "small", "sample"),
    "sample_prioritized": (
        "prioritized sample of 256 + update of their 256 priorities",
        "batches/s",
        "small",
        "prio",
    ),
    "atari_insert_fill": ("Atari single-row insert, first fill", "rows/s", "atari", "fill"),
    "atari_insert_steady": ("Atari single-row insert, steady", "rows/s", "atari", "steady"),
    "atari_sample": ("Atari uniform sample of 256", "batches/s", "atari", "sample"),
    "seq_insert": ("sequence step insert (T=16, period 1)", "steps/s", "small", "seq_fill"),
    "seq_sample": ("sequence sample of 32 windows x 16", "batches/s", "small", "seq_sample"),
    "insert1_steady_scalars": (
        "single-row insert, steady, scalars as numpy scalars (not 0-d arrays)",
        "rows/s",
        "small",
        "steady",
    ),
    "insert1_pos_fill": (
        "single-row insert, leaves positionally, first fill",
        "rows/s",
        "small",
        "fill",
    ),
    "insert1_pos_steady": (
        "single-row insert, leaves positionally, steady",
        "rows/s",
        "small",
        "steady",
    ),
}


# --------------------------------------------------------------------------- data


def small_pool(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` distinct transitions as columns."""
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.standard_normal((n, OBS), dtype=np.float32),
        "action": rng.integers(0, 18, n, dtype=np.int64),
        "reward": rng.standard_normal(n, dtype=np.float32),
        "done": rng.random(n) < 0.01,
    }


def atari_pool(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` distinct Atari transitions (random frames) as columns."""
    cols = small_pool(n, seed)
    cols["obs"] = np.random.default_rng(seed + 1).integers(0, 256, (n, *FRAME), dtype=np.uint8)
    return cols


def pool_slices(cols: dict[str, np.ndarray], rows: int) -> Iterator[tuple[int, int]]:
    """(start, stop) of consecutive runs of at most ``rows`` pool rows, cycling the pool."""
    n = len(cols["obs"])
    start = 0
    while True:
        stop = min(start + rows, n)
        yield start, stop
        start = 0 if stop == n else stop


def touch(arrays: Any) -> float:
    """Reads one element of every array (after ``np.asarray``): what a learner's first use of
    each leaf costs at least."""
    acc = 0.0
    for v in arrays:
        a = np.asarray(v)
        acc += float(a.flat[-1])
    return acc


def memory_kib() -> dict[str, int]:
    """This process's resident memory and the part of it on transparent huge pages (KiB)."""
    return c.proc_kib("/proc/self/smaps_rollup", "Rss", "AnonHugePages")


def shapes(arrays: Any) -> list[list[int]]:
    return [list(np.asarray(v).shape) for v in arrays]


# --------------------------------------------------------------------------- libraries
#
# Each library: ``new(data, size, prio)`` a table; ``rows(cols)`` the pool as single-row
# inputs and ``batches(cols)`` as 64-row inputs, for ``put1(t)`` / ``put64(t)``, called in the
# library's style ("one": put(x), "star": put(*x), "kw": put(**x)); where it takes a row's
# leaves positionally, ``pos_rows(cols)`` for ``put_pos(t)``, called put(*x);
# ``prefill(t, cols, size, prio, prios)`` fills a table untimed through the fastest batch path;
# ``draw(t, prio)`` a
# function i -> (arrays of one batch, keys to update) and ``update(t)`` the priority update;
# ``stored(t)`` the rows a table holds (None where it cannot say); the sequence tables alike.


class Library:
    name = ""
    style = "one"
    api: dict[str, str] = {}  # noqa: RUF012  (read only)
    unsupported: dict[str, str] = {}  # noqa: RUF012  (row or data -> why)

    def versions(self) -> dict[str, str | None]:
        from importlib.metadata import PackageNotFoundError, version

        out: dict[str, str | None] = {"numpy": np.__version__}
        for dist in self.dists:
            try:
                out[dist] = version(dist)
            except PackageNotFoundError:
                out[dist] = None
        return out

    dists: tuple[str, ...] = ()


class Echo(Library):
    """Today's echo: a replay table (``sampler=Uniform()`` / ``Prioritized(0.6)``), a sequence
    table (``sequence=Sequence(16, 1)``)."""

    name = "echo"
    dists = ("id-echo",)
    api = {  # noqa: RUF012
        "new": "Server(example, batch_size, sampler=Uniform() | Prioritized(0.6), max_size)",
        "insert1": "submit(row)",
        "insert1_pos": "writer()(*leaves) (a SampleWriter: the example's leaves in order)",
        "insert64": "submit_batch(rows)",
        "sample": "sample() (read-only views of a gathered batch)",
        "prio": "sample() + update_priorities(keys, prios)",
        "seq": "Server(..., sequence=Sequence(16, 1)), submit(step, stream=k, end_episode=e), "
        "sample() (views, with a mask)",
    }

    def __init__(self, batch: int, seq_length: int, seq_period: int, seq_batch: int) -> None:
        import echo

        self.echo = echo
        self.batch, self.seq_batch = batch, seq_batch
        self.seq_length, self.seq_period = seq_length, seq_period

    @staticmethod
    def example(data: str) -> dict[str, np.ndarray]:
        obs = np.zeros(FRAME, np.uint8) if data == "atari" else np.zeros(OBS, np.float32)
        return {
            "obs": obs,
            "action": np.zeros((), np.int64),
            "reward": np.zeros((), np.float32),
            "done": np.zeros((), np.bool_),
        }

    def new(self, data: str, size: int, prio: bool) -> Any:
        sampler = self.echo.Prioritized(0.6) if prio else self.echo.Uniform()
        return self.echo.Server(
            self.example(data), self.batch, sampler=sampler, max_size=size, seed=0
        )

    @staticmethod
    def rows(cols: dict[str, np.ndarray], scalars: bool = False) -> list[Any]:
        """One dict per pool row: the obs a view of its row; the scalar leaves 0-d arrays
        (views, the example's form), or numpy scalars (``np.int64``...) with ``scalars``."""
        keys = list(cols)
        if scalars:
            return [{k: cols[k][i] for k in keys} for i in range(len(cols["obs"]))]
        return [{k: cols[k][i, ...] for k in keys} for i in range(len(cols["obs"]))]

    @staticmethod
    def batches(cols: dict[str, np.ndarray]) -> list[Any]:
        n = len(cols["obs"]) // BATCH_ROWS * BATCH_ROWS
        return [
            {k: v[i : i + BATCH_ROWS] for k, v in cols.items()} for i in range(0, n, BATCH_ROWS)
        ]

    @staticmethod
    def put1(t: Any) -> Callable[..., Any]:
        return t.submit

    @staticmethod
    def pos_rows(cols: dict[str, np.ndarray]) -> list[Any]:
        """One tuple per pool row, in the example's leaf order (its keys sorted): action,
        done, obs, reward; the scalars 0-d arrays, as in ``rows``."""
        keys = sorted(cols)
        return [tuple(cols[k][i, ...] for k in keys) for i in range(len(cols["obs"]))]

    @staticmethod
    def put_pos(t: Any) -> Callable[..., Any]:
        return t.writer()

    @staticmethod
    def put64(t: Any) -> Callable[..., Any]:
        return t.submit_batch

    @staticmethod
    def prefill(t: Any, cols: dict[str, np.ndarray], size: int, prio: bool, prios: Any) -> None:
        done = 0
        for a, b in pool_slices(cols, 4096):
            m = min(b - a, size - done)
            part = {k: v[a : a + m] for k, v in cols.items()}
            t.submit_batch(part, priority=prios[a : a + m] if prio else None)
            done += m
            if done >= size:
                return

    @staticmethod
    def stored(t: Any) -> int | None:
        return int(t.stats().store_size)

    @staticmethod
    def draw(t: Any, prio: bool) -> Callable[[int], tuple[list[Any], Any]]:
        sample = t.sample

        if prio:

            def draw_prio(_i: int) -> tuple[list[Any], Any]:
                s = sample()
                return [*s.batch.values(), s.keys, s.probabilities], s.keys

            return draw_prio

        def draw_uniform(_i: int) -> tuple[list[Any], Any]:
            return list(sample().batch.values()), None

        return draw_uniform

    @staticmethod
    def update(t: Any) -> Callable[[Any, Any], Any]:
        return t.update_priorities

    # sequences: K streams in turn, each one episode after another
    def seq_new(self, size: int) -> Any:
        return self.echo.Server(
            self.example("small"),
            self.seq_batch,
            sequence=self.echo.Sequence(self.seq_length, self.seq_period),
            sampler=self.echo.Uniform(),
            max_size=size,
            seed=0,
        )

    seq_style = "echo_seq"

    @staticmethod
    def seq_steps(cols: dict[str, np.ndarray], streams: list[int], ends: list[bool]) -> list[Any]:
        rows = Echo.rows(cols)
        return [(rows[i], streams[i], ends[i]) for i in range(len(rows))]

    @staticmethod
    def seq_put(t: Any) -> Callable[..., Any]:
        return t.submit

    @staticmethod
    def seq_prefill(
        t: Any, cols: dict[str, np.ndarray], size: int, streams: int, ends: list[bool]
    ) -> None:
        # one submit_batch per vector step: row i is stream i (the pool is stream-major in
        # turn: pool row j is stream j % streams)
        n = len(cols["obs"]) // streams * streams
        done = 0
        while done < size:
            for a in range(0, n, streams):
                part = {k: v[a : a + streams] for k, v in cols.items()}
                t.submit_batch(part, stream=0, end_episode=np.array(ends[a : a + streams]))
                done += streams
                if done >= size:
                    return

    @staticmethod
    def seq_draw(t: Any) -> Callable[[int], list[Any]]:
        sample = t.sample

        def draw(_i: int) -> list[Any]:
            s = sample()
            return [*s.batch.values(), s.mask]

        return draw

    @staticmethod
    def seq_stored(t: Any) -> int | None:
        return int(t.stats().steps_stored)


class Cpprb(Library):
    name = "cpprb"
    dists = ("cpprb",)
    style = "kw"
    api = {  # noqa: RUF012
        "new": "ReplayBuffer(size, env_dict) / PrioritizedReplayBuffer(size, env_dict, alpha=0.6)",
        "insert1": "add(obs=, act=, rew=, done=)",
        "insert64": "add(...) with 64-row arrays",
        "sample": "sample(256) (a dict of new arrays: copies)",
        "prio": "sample(256, beta=0.4) + update_priorities(indexes, prios)",
    }
    unsupported = {  # noqa: RUF012
        "seq": "no sequence (window) sampler",
        "insert1_pos": "add() takes keywords only (rows 1 and 2)",
    }

    def __init__(self, batch: int) -> None:
        import cpprb

        self.cpprb = cpprb
        self.batch = batch

    @staticmethod
    def env_dict(data: str) -> dict[str, Any]:
        obs = {"shape": FRAME, "dtype": np.uint8} if data == "atari" else {"shape": OBS}
        return {
            "obs": {"dtype": np.float32, **obs},
            "act": {"dtype": np.int64},
            "rew": {"dtype": np.float32},
            "done": {"dtype": np.bool_},
        }

    def new(self, data: str, size: int, prio: bool) -> Any:
        if prio:
            return self.cpprb.PrioritizedReplayBuffer(size, self.env_dict(data), alpha=0.6)
        return self.cpprb.ReplayBuffer(size, self.env_dict(data))

    @staticmethod
    def _kw(
        cols: dict[str, np.ndarray], a: int, b: int | None = None, scalars: bool = False
    ) -> dict[str, Any]:
        if b is None:  # one row, as Echo.rows gives it
            i: Any = a if scalars else (a, ...)
            return {
                "obs": cols["obs"][a],
                "act": cols["action"][i],
                "rew": cols["reward"][i],
                "done": cols["done"][i],
            }
        return {
            "obs": cols["obs"][a:b],
            "act": cols["action"][a:b],
            "rew": cols["reward"][a:b],
            "done": cols["done"][a:b],
        }

    def rows(self, cols: dict[str, np.ndarray], scalars: bool = False) -> list[Any]:
        return [self._kw(cols, i, scalars=scalars) for i in range(len(cols["obs"]))]

    def batches(self, cols: dict[str, np.ndarray]) -> list[Any]:
        n = len(cols["obs"]) // BATCH_ROWS * BATCH_ROWS
        return [self._kw(cols, i, i + BATCH_ROWS) for i in range(0, n, BATCH_ROWS)]

    @staticmethod
    def put1(t: Any) -> Callable[..., Any]:
        return t.add

    put64 = put1

    def prefill(self, t: Any, cols: dict[str, np.ndarray], size: int, prio: bool, prios: Any):
        done = 0
        for a, b in pool_slices(cols, 4096):
            m = min(b - a, size - done)
            if prio:
                t.add(priorities=prios[a : a + m], **self._kw(cols, a, a + m))
            else:
                t.add(**self._kw(cols, a, a + m))
            done += m
            if done >= size:
                return

    @staticmethod
    def stored(t: Any) -> int | None:
        return int(t.get_stored_size())

    def draw(self, t: Any, prio: bool) -> Callable[[int], tuple[list[Any], Any]]:
        sample, b = t.sample, self.batch

        if prio:

            def draw_prio(_i: int) -> tuple[list[Any], Any]:
                s = sample(b, beta=0.4)
                return list(s.values()), s["indexes"]

            return draw_prio

        def draw_uniform(_i: int) -> tuple[list[Any], Any]:
            return list(sample(b).values()), None

        return draw_uniform

    @staticmethod
    def update(t: Any) -> Callable[[Any, Any], Any]:
        return t.update_priorities


class Rlox(Library):
    name = "rlox"
    dists = ("rlox", "torch")
    style = "star"
    api = {  # noqa: RUF012
        "new": "ReplayBuffer(size, 84, 1) / PrioritizedReplayBuffer(size, 84, 1, alpha=0.6, "
        "beta=0.4)",
        "insert1": "push(obs, action, reward, terminated, truncated) (next_obs: zeros)",
        "insert1_pos": "push(obs, action, reward, terminated, truncated), as rows 1 and 2",
        "insert64": "push_batch(obs, next_obs, actions, rewards, terminated, truncated) "
        "(flat arrays)",
        "sample": "sample(256, seed) (a dict of new arrays: copies, next_obs included)",
        "prio": "sample(256, seed) + update_priorities(indices, prios)",
        "seq": "SequenceReplayBuffer(size, 84, 1), push(obs, next_obs, action, reward, "
        "terminated, truncated), sample_sequences(32, 16, seed) (copies)",
    }
    unsupported = {  # noqa: RUF012
        "atari": "stores observations as float32 only (with a next_obs column): no uint8 frames"
    }

    def __init__(self, batch: int, seq_length: int, seq_batch: int) -> None:
        import rlox

        self.rlox = rlox
        self.batch, self.seq_length, self.seq_batch = batch, seq_length, seq_batch

    def new(self, data: str, size: int, prio: bool) -> Any:
        if prio:
            return self.rlox.PrioritizedReplayBuffer(size, OBS, 1, alpha=0.6, beta=0.4)
        return self.rlox.ReplayBuffer(size, OBS, 1)

    @staticmethod
    def _actions(cols: dict[str, np.ndarray]) -> np.ndarray:
        return cols["action"].astype(np.float32).reshape(-1, 1)

    def rows(self, cols: dict[str, np.ndarray], scalars: bool = False) -> list[Any]:
        """Python float and bool (it takes no 0-d array), or numpy scalars with ``scalars``;
        the action an ``f32[1]`` array either way (it takes nothing else)."""
        act = self._actions(cols)
        rew, done = cols["reward"], cols["done"]
        if scalars:
            return [(cols["obs"][i], act[i], rew[i], done[i], False) for i in range(len(rew))]
        return [
            (cols["obs"][i], act[i], float(rew[i]), bool(done[i]), False) for i in range(len(rew))
        ]

    def batches(self, cols: dict[str, np.ndarray]) -> list[Any]:
        act = self._actions(cols).reshape(-1)
        done = cols["done"].astype(np.uint8)
        trunc = np.zeros_like(done)
        n = len(cols["obs"]) // BATCH_ROWS * BATCH_ROWS
        out = []
        for i in range(0, n, BATCH_ROWS):
            obs = cols["obs"][i : i + BATCH_ROWS].reshape(-1)
            j = slice(i, i + BATCH_ROWS)
            out.append((obs, obs, act[j], cols["reward"][j], done[j], trunc[j]))
        return out

    @staticmethod
    def put1(t: Any) -> Callable[..., Any]:
        return t.push

    def pos_rows(self, cols: dict[str, np.ndarray]) -> list[Any]:
        return self.rows(cols)

    @staticmethod
    def put_pos(t: Any) -> Callable[..., Any]:
        return t.push

    @staticmethod
    def put64(t: Any) -> Callable[..., Any]:
        return t.push_batch

    def prefill(self, t: Any, cols: dict[str, np.ndarray], size: int, prio: bool, prios: Any):
        if prio:  # no batch push for the prioritized buffer
            rows = self.rows(cols)
            push = t.push
            for i in range(size):
                j = i % len(rows)
                push(*rows[j], priority=float(prios[j]))
            return
        batches = self.batches(cols)
        done = 0
        while done < size:
            for x in batches:
                t.push_batch(*x)
                done += BATCH_ROWS
                if done >= size:
                    return

    @staticmethod
    def stored(t: Any) -> int | None:
        return len(t)

    def draw(self, t: Any, prio: bool) -> Callable[[int], tuple[list[Any], Any]]:
        sample, b = t.sample, self.batch

        def draw(i: int) -> tuple[list[Any], Any]:
            s = sample(b, i)
            return list(s.values()), s["indices"] if prio else None

        return draw

    @staticmethod
    def update(t: Any) -> Callable[[Any, Any], Any]:
        return t.update_priorities

    def seq_new(self, size: int) -> Any:
        return self.rlox.SequenceReplayBuffer(size, OBS, 1)

    seq_style = "star"

    def seq_steps(
        self, cols: dict[str, np.ndarray], streams: list[int], ends: list[bool]
    ) -> list[Any]:
        # one stream: rlox has no streams, its episodes follow each other
        act = self._actions(cols)
        obs = cols["obs"]
        n = len(obs)
        return [
            (obs[i], obs[(i + 1) % n], act[i], float(cols["reward"][i]), ends[i], False)
            for i in range(n)
        ]

    @staticmethod
    def seq_put(t: Any) -> Callable[..., Any]:
        return t.push

    def seq_prefill(
        self, t: Any, cols: dict[str, np.ndarray], size: int, streams: int, ends: list[bool]
    ) -> None:
        steps = self.seq_steps(cols, [], ends)
        push = t.push
        for i in range(size):
            push(*steps[i % len(steps)])

    def seq_draw(self, t: Any) -> Callable[[int], list[Any]]:
        sample, b, n = t.sample_sequences, self.seq_batch, self.seq_length

        def draw(i: int) -> list[Any]:
            return list(sample(b, n, i).values())

        return draw

    @staticmethod
    def seq_stored(t: Any) -> int | None:
        return len(t)


class IdEcho(Library):
    """The published echo 0.2.1: a FIFO batching ring only (no replay table, no sampler, no
    batch insert, no sequences). Its insert rows fill a ring of the table's size; steady
    inserts run with the ring full and a consumer that takes one batch of ``ring_batch`` rows
    (a view) before each ``ring_batch`` inserts, timed with them."""

    name = "id-echo"
    dists = ("id-echo",)
    api = {  # noqa: RUF012
        "new": "Server(example, batch_size=B, num_buffers=size // B) (a FIFO ring)",
        "insert1": "submit(row) (ring full and wrapping: one sample() per B rows, timed)",
    }
    unsupported = {  # noqa: RUF012
        "insert64": "no batch insert",
        "insert1_pos": "no positional insert",
        "sample": "FIFO only: no replay table to sample from",
        "prio": "FIFO only: no priorities",
        "seq": "no sequence tables",
    }

    def __init__(self) -> None:
        import echo

        self.echo = echo

    @staticmethod
    def ring_batch(size: int) -> int:
        return max(1, min(1000, size // 10))

    def new(self, data: str, size: int, prio: bool) -> Any:
        b = self.ring_batch(size)
        return self.echo.Server(Echo.example(data), batch_size=b, num_buffers=size // b)

    rows = staticmethod(Echo.rows)
    put1 = staticmethod(Echo.put1)

    @staticmethod
    def prefill(t: Any, cols: dict[str, np.ndarray], size: int, prio: bool, prios: Any) -> None:
        rows = Echo.rows(cols)
        submit = t.submit
        for i in range(size):
            submit(rows[i % len(rows)])

    @staticmethod
    def stored(t: Any) -> int | None:
        return None


class Memcpy(Library):
    """The ceiling of a gather of Atari frames: ``np.copyto`` of one batch's bytes (256
    frames gathered beforehand, 16 such sources in turn, more than a last-level cache) into
    one destination."""

    name = "memcpy"
    api = {"sample": "np.copyto of 256 gathered frames per batch"}  # noqa: RUF012


CLASSES: dict[str, type[Library]] = {
    "echo": Echo,
    "cpprb": Cpprb,
    "rlox": Rlox,
    "id-echo": IdEcho,
    "memcpy": Memcpy,
}

# --------------------------------------------------------------------------- loops


def insert_loop(
    put: Callable[..., Any],
    style: str,
    chunks: list[list[Any]],
    calls: int,
    deadline: float,
    before_chunk: Callable[[], Any] | None = None,
) -> int:
    """Calls ``put`` on the items of ``chunks`` in turn (``calls`` at most, the deadline
    checked after each chunk); returns the calls made."""
    done = 0
    k = 0
    while done < calls:
        chunk = chunks[k]
        k = k + 1 if k + 1 < len(chunks) else 0
        if calls - done < len(chunk):
            chunk = chunk[: calls - done]
        if before_chunk is not None:
            before_chunk()
        if style == "one":
            for x in chunk:
                put(x)
        elif style == "star":
            for x in chunk:
                put(*x)
        elif style == "kw":
            for x in chunk:
                put(**x)
        else:  # echo_seq
            for x, stream, end in chunk:
                put(x, stream=stream, end_episode=end)
        done += len(chunk)
        if time.perf_counter() >= deadline:
            break
    return done


def sample_loop(
    fn: Callable[[int], float], seconds: float, max_calls: int, start: int
) -> tuple[int, float]:
    """Calls ``fn(i)`` until ``seconds`` have passed or ``max_calls`` calls; returns (calls,
    elapsed seconds)."""
    t0 = time.perf_counter()
    deadline = t0 + seconds
    i = 0
    while i < max_calls:
        fn(start + i)
        i += 1
        if time.perf_counter() >= deadline:
            break
    return i, time.perf_counter() - t0


def chunked(items: list[Any], size: int) -> list[list[Any]]:
    """``items`` cut into chunks of exactly ``size`` (the last one, and any chunk when there
    are fewer items than ``size``, filled by starting over)."""
    n = len(items)
    return [[items[(k + j) % n] for j in range(size)] for k in range(0, n, size)]


def seq_schedule(n: int, streams: int, episode: int) -> tuple[list[int], list[bool]]:
    """Pool row ``i`` is a step of stream ``i % streams``, its ``i // streams``-th step; a
    step ends its episode every ``episode`` steps of its stream. ``n`` is a multiple of
    ``streams * episode``, so the pool cycles without breaking an episode."""
    stream = [i % streams for i in range(n)]
    ends = [(i // streams) % episode == episode - 1 for i in range(n)]
    return stream, ends


# --------------------------------------------------------------------------- measurements


def make_library(lib: str, p: dict[str, Any]) -> Library:
    if lib == "echo":
        return Echo(p["batch"], p["seq_length"], p["seq_period"], p["seq_batch"])
    if lib == "cpprb":
        return Cpprb(p["batch"])
    if lib == "rlox":
        return Rlox(p["batch"], p["seq_length"], p["seq_batch"])
    if lib == "id-echo":
        return IdEcho()
    if lib == "memcpy":
        return Memcpy()
    raise ValueError(f"no library {lib!r}")


def feature_of(row: str) -> str:
    """The key of ``Library.api`` / ``unsupported`` that ``row`` measures."""
    kind = ROWS[row][3]
    if kind in ("fill", "steady"):
        if row.startswith("insert1_pos"):
            return "insert1_pos"
        return "insert64" if row.startswith("insert64") else "insert1"
    return {"sample": "sample", "prio": "prio"}.get(kind, "seq")


def why_unsupported(impl: Library | type[Library], row: str) -> str | None:
    """Why library ``impl`` (an instance or its class) has no number for ``row``, or None."""
    if impl.name == "memcpy":
        return None if row == "atari_sample" else "the memcpy ceiling is of the Atari sample"
    data = ROWS[row][2]
    if data in impl.unsupported:
        return impl.unsupported[data]
    feature = feature_of(row)
    return impl.unsupported.get(feature) or (None if feature in impl.api else "not measured")


def api_of(impl: Library | type[Library], row: str) -> str:
    return impl.api.get(feature_of(row), "")


def measure_inserts(impl: Any, row: str, p: dict[str, Any], log: Callable[[str], None]) -> dict:
    _, _, data, kind = ROWS[row]
    size = int(p["atari_size"] if data == "atari" else p["size"])
    cols = atari_pool(int(p["atari_pool"])) if data == "atari" else small_pool(int(p["pool"]))
    batch64 = row.startswith("insert64")
    positional = feature_of(row) == "insert1_pos"
    if positional:
        items = impl.pos_rows(cols)
    else:
        items = impl.batches(cols) if batch64 else impl.rows(cols, row.endswith("_scalars"))
    per_call = BATCH_ROWS if batch64 else 1
    style = "star" if positional else impl.style

    def putter(t: Any) -> Callable[..., Any]:
        if positional:
            return impl.put_pos(t)
        return impl.put64(t) if batch64 else impl.put1(t)

    ring = impl.name == "id-echo"
    chunk_rows = IdEcho.ring_batch(size) if ring else CHUNK
    # for the ring, every chunk is exactly one ring batch: the consumer frees one per chunk
    chunks = chunked(items, max(1, chunk_rows // per_call))
    rates, construct, counts, seconds = [], [], [], []
    correct = True
    repeats = int(p["repeats"])
    if kind == "fill":
        for r in range(repeats):
            gc.collect()
            t0 = time.perf_counter()
            t = impl.new(data, size, False)
            construct.append(time.perf_counter() - t0)
            put = putter(t)
            t0 = time.perf_counter()
            calls = insert_loop(put, style, chunks, size // per_call, t0 + p["fill_seconds"])
            dt = time.perf_counter() - t0
            rows = calls * per_call
            memory = memory_kib()
            stored = impl.stored(t)
            if stored is not None and stored != rows:
                correct = False
                log(f"{impl.name} {row}: {rows} rows inserted, the table holds {stored}")
            rates.append(c.rate(rows, dt))
            counts.append(rows)
            seconds.append(dt)
            log(f"{impl.name} {row} #{r + 1}: {rows:,} rows in {dt:.2f} s: {rates[-1]:,.0f}/s")
            del t, put
        return {
            "rates": rates,
            "rows": counts,
            "seconds": seconds,
            "construct_s": construct,
            "memory_kib": memory,
            "correct": correct,
        }
    t0 = time.perf_counter()
    t = impl.new(data, size, False)
    impl.prefill(t, cols, size, False, None)
    setup = time.perf_counter() - t0
    memory = memory_kib()
    stored = impl.stored(t)
    if stored is not None and stored != size:
        correct = False
        log(f"{impl.name} {row}: prefilled {size} rows, the table holds {stored}")
    put = putter(t)
    hook = None
    if ring:
        t.sample()  # the consumer holds one batch; each sample() then frees the one before
        hook = t.sample
    for r in range(repeats):
        t0 = time.perf_counter()
        calls = insert_loop(put, style, chunks, size // per_call, t0 + p["seconds"], hook)
        dt = time.perf_counter() - t0
        rows = calls * per_call
        rates.append(c.rate(rows, dt))
        counts.append(rows)
        seconds.append(dt)
        log(f"{impl.name} {row} #{r + 1}: {rows:,} rows in {dt:.2f} s: {rates[-1]:,.0f}/s")
    stored = impl.stored(t)
    if stored is not None and stored != size:
        correct = False
        log(f"{impl.name} {row}: the full table holds {stored}, not {size}")
    return {
        "rates": rates,
        "rows": counts,
        "seconds": seconds,
        "setup_s": setup,
        "memory_kib": memory,
        "correct": correct,
    }


def _check_shapes(got: list[list[int]], lead: list[int]) -> bool:
    return bool(got) and all(s[: len(lead)] == lead for s in got)


def sample_windows(
    fn: Callable[[int], float], p: dict[str, Any], who: str, log: Callable[[str], None]
) -> dict[str, Any]:
    """``repeats`` windows of ``fn`` after a warm-up of 5 calls: the rates of each."""
    for i in range(5):
        fn(i)
    rates, counts, seconds = [], [], []
    start = 5
    for r in range(int(p["repeats"])):
        calls, dt = sample_loop(fn, float(p["seconds"]), int(p["max_calls"]), start)
        start += calls
        rates.append(c.rate(calls, dt))
        counts.append(calls)
        seconds.append(dt)
        log(f"{who} #{r + 1}: {calls:,} batches in {dt:.2f} s: {rates[-1]:,.0f}/s")
    return {"rates": rates, "batches": counts, "seconds": seconds}


def measure_samples(impl: Any, row: str, p: dict[str, Any], log: Callable[[str], None]) -> dict:
    _, _, data, kind = ROWS[row]
    size = int(p["atari_size"] if data == "atari" else p["size"])
    batch = int(p["batch"])
    prio = kind == "prio"
    cols = atari_pool(int(p["atari_pool"])) if data == "atari" else small_pool(int(p["pool"]))
    t0 = time.perf_counter()
    correct = True
    if impl.name == "memcpy":
        rng = np.random.default_rng(2)
        n_src = 16
        srcs = [cols["obs"][rng.integers(0, len(cols["obs"]), batch)] for _ in range(n_src)]
        dst = np.empty_like(srcs[0])

        def fn(i: int) -> float:
            np.copyto(dst, srcs[i % n_src])
            return float(dst.flat[-1])

        first = [list(dst.shape)]
    else:
        rng = np.random.default_rng(3)
        fill_prios = rng.random(len(cols["obs"])) + 0.01
        t = impl.new(data, size, prio)
        impl.prefill(t, cols, size, prio, fill_prios)
        stored = impl.stored(t)
        if stored is not None and stored != size:
            correct = False
            log(f"{impl.name} {row}: prefilled {size} rows, the table holds {stored}")
        draw = impl.draw(t, prio)
        prios = [rng.random(batch) + 0.01 for _ in range(64)]
        update = impl.update(t) if prio else None
        first = shapes(draw(0)[0])

        def fn(i: int) -> float:
            arrays, keys = draw(i)
            acc = touch(arrays)
            if update is not None:
                update(keys, prios[i & 63])
            return acc

    setup = time.perf_counter() - t0
    memory = memory_kib()
    correct = correct and _check_shapes(first, [batch])
    out = sample_windows(fn, p, f"{impl.name} {row}", log)
    return {
        **out,
        "first_shapes": first,
        "setup_s": setup,
        "memory_kib": memory,
        "correct": correct,
    }


def measure_sequences(impl: Any, row: str, p: dict[str, Any], log: Callable[[str], None]) -> dict:
    _, _, _, kind = ROWS[row]
    size, streams, episode = int(p["seq_size"]), int(p["seq_streams"]), int(p["seq_episode"])
    unit = streams * episode
    cols = small_pool(max(1, int(p["pool"]) // unit) * unit)
    stream_of, ends = seq_schedule(len(cols["obs"]), streams, episode)
    correct = True
    if kind == "seq_fill":
        steps = impl.seq_steps(cols, stream_of, ends)
        chunks = chunked(steps, CHUNK)
        rates, construct, counts, seconds = [], [], [], []
        for r in range(int(p["repeats"])):
            gc.collect()
            t0 = time.perf_counter()
            t = impl.seq_new(size)
            construct.append(time.perf_counter() - t0)
            put = impl.seq_put(t)
            t0 = time.perf_counter()
            done = insert_loop(put, impl.seq_style, chunks, size, t0 + p["fill_seconds"])
            dt = time.perf_counter() - t0
            stored = impl.seq_stored(t)
            if stored is not None and stored > done:
                correct = False
                log(f"{impl.name} {row}: {done} steps inserted, the table holds {stored}")
            rates.append(c.rate(done, dt))
            counts.append(done)
            seconds.append(dt)
            log(f"{impl.name} {row} #{r + 1}: {done:,} steps in {dt:.2f} s: {rates[-1]:,.0f}/s")
            del t, put
        return {
            "rates": rates,
            "steps": counts,
            "seconds": seconds,
            "construct_s": construct,
            "correct": correct,
        }
    t0 = time.perf_counter()
    t = impl.seq_new(size)
    impl.seq_prefill(t, cols, size, streams, ends)
    setup = time.perf_counter() - t0
    stored = impl.seq_stored(t)
    draw = impl.seq_draw(t)
    first = shapes(draw(0))

    def fn(i: int) -> float:
        return touch(draw(i))

    correct = _check_shapes(first, [int(p["seq_batch"]), int(p["seq_length"])])
    out = sample_windows(fn, p, f"{impl.name} {row}", log)
    return {**out, "first_shapes": first, "setup_s": setup, "stored": stored, "correct": correct}


def measure(lib: str, row: str, p: dict[str, Any]) -> dict[str, Any]:
    """One library's one row: ``{"unsupported": why}`` or its rates and ``best``."""
    log = c.logger(f"peers[{lib}]")
    head: dict[str, Any] = {"lib": lib, "row": row, "load_before": c.loadavg()}
    impl = make_library(lib, p)
    head["versions"] = impl.versions()
    why = why_unsupported(impl, row)
    if why is not None:
        return {**head, "unsupported": why, "correct": True}
    head["api"] = api_of(impl, row)
    kind = ROWS[row][3]
    if kind in ("fill", "steady"):
        out = measure_inserts(impl, row, p, log)
    elif kind in ("sample", "prio"):
        out = measure_samples(impl, row, p, log)
    else:
        out = measure_sequences(impl, row, p, log)
    rates = [r for r in out["rates"] if r == r]
    return {**head, **out, "best": max(rates) if rates else None, "load_after": c.loadavg()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lib", choices=list(CLASSES))
    ap.add_argument("row", choices=list(ROWS))
    ap.add_argument("params", help="the suite's parameters, JSON")
    ap.add_argument("--json", required=True, help="where the result goes")
    args = ap.parse_args(argv)
    p = json.loads(args.params)
    c.watchdog(float(p["child_timeout"]))
    try:
        doc = measure(args.lib, args.row, p)
    except ImportError as e:
        doc = {"lib": args.lib, "row": args.row, "error": f"not installed: {e}"}
    except Exception as e:  # noqa: BLE001  reported in the record, not lost
        import traceback

        traceback.print_exc()
        doc = {"lib": args.lib, "row": args.row, "error": f"{type(e).__name__}: {e}"}
    c.write_json(args.json, doc, say=False)
    return 0 if "error" not in doc else 1


if __name__ == "__main__":
    sys.exit(main())
