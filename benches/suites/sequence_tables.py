"""Sequence tables: how fast ``sample()`` assembles batches of windows, against a plain
memcpy of the same bytes, a numpy gather and TorchRL's ``SliceSampler``, and how many
resident bytes a stored step costs.

Two steps (``--kinds``): ``atari``, ``{"obs": u8[84, 84], "action": i64, "reward": f32,
"discount": f32}`` = 7,072 B, and ``small``, ``{"obs": f32[60], ...}`` = 256 B. For each:

* **echo**: ``Server(step, batch_size=64, sequence=Sequence(80, 40, "pad"),
  max_size=steps, sampler=Uniform(), seed=0)`` filled with ``--steps`` (``--small-steps``)
  steps by ``submit_batch`` of one step of each of ``--streams`` streams per call. Every
  stream is a run of episodes of random lengths in [``--min-episode``, ``--max-episode``]
  (one seeded RNG per stream). A step's id is ``stream * 10**7 + t`` (``t``: the stream's
  step counter); ``action`` holds it, ``obs`` is a frame from a pool of ``--frame-pool``
  distinct random frames chosen by hashing the id, with the id stamped over its first 8
  bytes, so no two stored steps are alike. Then ``sample()`` is timed alone, batch after
  batch (``--batches`` or ``--seconds``, whichever ends first), and a consumer reads every
  batch (one byte of every 64 of every leaf, so every cache line is touched) between calls.
* **memcpy**: in the same loop, interleaved with ``sample()`` so that both see the same
  machine, ``np.copyto`` of one batch's bytes (``64 * 80 * step_bytes``) between two
  preallocated buffers, followed by the same consumer. Bandwidths count one batch's step
  bytes per call (echo also writes the mask and the per-window values, left out).
* **numpy**: the same steps in flat arrays (one per leaf, each stream's steps contiguous),
  windows drawn uniformly from the same starts (0, 40, 80, ... of every episode, full
  windows only: numpy does not pad), gathered per leaf with ``arr[idx[:, None] +
  arange(80)]`` (``numpy_fancy``, a fresh array per call, as users write it) and with
  ``np.take(arr, idx, axis=0, out=buf, mode="clip")`` into a preallocated buffer
  (``numpy_take``, numpy at its best).
* **torchrl** (with ``--torchrl-python PATH``, an interpreter that has torchrl): this file
  re-run there as a child process (it imports no echo then), ``ReplayBuffer(storage=
  LazyTensorStorage(steps), sampler=SliceSampler(slice_len=80, traj_key="episode",
  cache_values=True), batch_size=64 * 80)`` over the same flat steps; ``rb.sample()`` timed.
* **memory**, each figure in a fresh child process (so that no memory an earlier phase
  freed is reused unseen): the resident set (``/proc/self/status`` VmRSS) before the server
  is made, after, after the fill and after two batches; bytes per stored step = (after fill
  - before) / ``steps_stored`` with the table full (``max_size`` = the steps submitted),
  against the step's own bytes. And the
  alternative users have today: whole windows (made with ``TrajectoryAccumulator`` on the
  worker) sent as samples of a replay table, ``Server(window, batch_size=64,
  sampler=Uniform(), max_size=windows)``, filled with ``--alt-steps / period`` windows by
  ``submit_batch``: every step is stored ``length / period`` = 2 times.

``correct`` is checked before the numbers are trusted: in the first batches and the last,
every window's real steps are consecutive steps of one episode of one stream, ``mask`` is
true exactly on them (``min(80, steps left in the episode)``), padding is zeros, ``start``,
``stream`` and ``terminated`` agree with what was submitted, and ``obs`` carries its step's
stamp (and, for one window per batch, its whole frame). The numpy and TorchRL gathers are
checked the same way (consecutive ids of one episode).

**tcp** (``--parts``: ``sample`` is all of the above, ``tcp`` this; both by default): the
issue's target "step inserts over TCP with 16 workers within 10% of plain sample inserts of
the same step size". One pool of ``--tcp-workers`` worker processes (``spawn``: this
interpreter and ``sys.path``; each checks that it imported the learner's echo) serves every
round. A round: this process starts a server on 127.0.0.1, ``TcpTransport(port=0,
host="127.0.0.1")``, either a sequence table (**steps**: ``Server(step, batch_size,
sequence=Sequence(80, period=40), sampler=Uniform(), max_size=--tcp-max-size)``) or a replay
table of the same step (**samples**: ``Server(step, batch_size, sampler=Uniform(),
max_size=...)``); every worker connects ``TcpClient(host, port, step,
shared_memory=False)`` (path ``tcp``) or ``shared_memory=True`` (path ``shm``), then sends one
``send()`` per step (id stamped into ``action`` and ``obs``) until the common end, with
``end_episode=True`` at its episodes' ends (lengths uniform in ``TCP_EPISODE``, seeded per
worker and round) for steps and no flag for samples, and ``close()``s (flushing). Meanwhile a
consumer thread samples batch after batch and reads every cache line of ``obs`` (off with
``--tcp-no-consumer``). Throughput: ``steps_inserted_total`` (``samples_inserted_total``)
read at the start and end of a ``--tcp-seconds`` window after ``--tcp-warmup``; workers go on
``TCP_TAIL_S`` past it. Per kind (``--tcp-kinds``; ``--quick``: small) and path,
``--tcp-pairs`` pairs of rounds alternate the two (steps first, then samples first, ...), so
drift favours neither; a mode's rate is its inserts over its summed windows; the ratio is
steps/s over samples/s (target >= 0.9). ``correct``: after every worker closed, the table
holds every step sent, episodes ended = ends sent + the open episodes closed, windows made =
sum of ``ceil(episode length / period)``, every worker sent and flushed, the shared-memory
connection count matches the path, and sampled batches (the first two and every 256th) hold
consecutive ids of one worker's stream (samples: stamps match ids).

Every loop is bounded in count and time, a watchdog ends the process after
``--max-seconds``, every ``sample()`` has a timeout; no network but 127.0.0.1, no threads but
the guards and the tcp part's consumer; the tcp workers are ended (by PID) in a ``finally``.

    python -m benches.suites.sequence_tables [--quick] [--out FILE.json] [--steps N] ...

Prints a table and writes one JSON record (``--out``/``--json``): the parameters, the
machine, each result with its ``correct`` flag, the ratios and whether the issue's targets
(assembly >= 50% of memcpy bandwidth; ahead of numpy on both steps, >= 5x on the small one;
<= 1.1x the step's bytes per stored step) were met. Depends on numpy and the standard
library (and echo, torchrl where they are measured).

This module holds the echo, numpy and TorchRL parts, the child processes and the run; the
step kinds, frames, episodes and flat arrays are in :mod:`benches.suites.sequence_data`, the
TCP part in :mod:`benches.suites.sequence_tcp`.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benches import common as h
from benches.suites.sequence_data import (
    ID_STRIDE,
    KINDS,
    MAX_BATCHES,
    MAX_STEPS,
    SAMPLE_TIMEOUT_S,
    Episodes,
    Frames,
    check_flat_windows,
    example,
    flat_chunks,
    flat_episode_ids,
    flat_tables,
    flat_window_starts,
    log,
    obs_stamps,
    rss_bytes,
    step_bytes,
    timing,
    touch,
)
from benches.suites.sequence_tcp import TCP_EPISODE, TCP_PATHS, TCP_TAIL_S, print_tcp, run_tcp

# --------------------------------------------------------------------------- echo


def check_echo_batch(
    s: Any,
    *,
    episodes: Episodes,
    frames: Frames,
    length: int,
    period: int,
    full_check: bool,
) -> str | None:
    """What is wrong with sequence batch ``s`` (None: nothing)."""
    batch = s.batch
    action = np.asarray(batch["action"])
    mask = np.asarray(s.mask)
    obs = np.asarray(batch["obs"])
    b = action.shape[0]
    if action.shape != (b, length) or mask.shape != (b, length):
        return f"shapes: action {action.shape}, mask {mask.shape}"
    stamps = obs_stamps(obs)
    for i in range(b):
        real = int(mask[i].sum())
        if real < 1 or not mask[i, :real].all():
            return f"window {i}: mask {mask[i].astype(int).tolist()} is not a prefix"
        first = int(action[i, 0])
        k, t0 = divmod(first, ID_STRIDE)
        if not np.array_equal(action[i, :real], first + np.arange(real)):
            return f"window {i}: action ids not consecutive: {action[i, :real].tolist()}"
        if np.any(action[i, real:] != 0) or np.any(obs[i, real:] != 0):
            return f"window {i}: padding is not zeros"
        if not np.array_equal(stamps[i, :real], action[i, :real]):
            return f"window {i}: obs stamps {stamps[i, :real].tolist()} differ from action"
        ep_start, ep_end = episodes.episode_of(k, t0)
        want_real = length if ep_end is None else min(length, ep_end - t0)
        if real != want_real:
            return f"window {i}: {real} real steps, expected {want_real} (episode end {ep_end})"
        if int(s.start[i]) != t0 - ep_start or (t0 - ep_start) % period:
            return f"window {i}: start {int(s.start[i])}, expected {t0 - ep_start}"
        if int(s.stream[i]) != k:
            return f"window {i}: stream {int(s.stream[i])}, expected {k}"
        if bool(s.terminated[i]) != (ep_end is not None) or bool(s.truncated[i]):
            return f"window {i}: terminated {bool(s.terminated[i])}, episode end {ep_end}"
        if full_check and i == 0:
            raw = obs[i].reshape(length, -1).view(np.uint8)
            for j in range(real):
                if not np.array_equal(raw[j], frames.expected_obs(first + j)):
                    return f"window {i}: obs of step {j} is not its frame"
    return None


def fill_echo(
    server: Any, kind: str, steps: int, streams: int, episodes: Episodes, frames: Frames,
    deadline: float,
) -> dict[str, Any]:  # fmt: skip
    """``steps // streams`` rounds of one step per stream through ``submit_batch``."""
    rounds = steps // streams
    stream_ids = np.arange(streams, dtype=np.int64) * ID_STRIDE
    submit_ns = 0
    t_start = time.perf_counter()
    done = 0
    for t in range(rounds):
        ends = np.fromiter((episodes.ends_at(k, t) for k in range(streams)), bool, streams)
        rows = frames.rows(stream_ids + t, ends)
        t0 = time.perf_counter_ns()
        server.submit_batch(rows, stream=0, end_episode=ends, timeout=SAMPLE_TIMEOUT_S)
        submit_ns += time.perf_counter_ns() - t0
        done += streams
        if time.perf_counter() > deadline:
            log(f"{kind}: fill stopped by the time limit after {done} steps")
            break
    wall = time.perf_counter() - t_start
    nbytes = done * step_bytes(kind)
    return {
        "steps": done,
        "rounds": done // streams,
        "wall_s": wall,
        "submit_s": submit_ns / 1e9,
        "steps_per_s": h.rate(done, submit_ns / 1e9),
        "submit_gb_per_s": h.rate(nbytes, submit_ns / 1e9) / 1e9,
    }


def sequence_server(kind: str, args: Any, steps: int) -> Any:
    """The sequence table under test: ``steps`` steps of ``kind``, windows of ``--length``
    every ``--period`` steps, padded at episode ends, drawn uniformly."""
    import echo

    return echo.Server(
        example(kind),
        batch_size=args.batch_size,
        sequence=echo.Sequence(length=args.length, period=args.period, at_end="pad"),
        max_size=steps,
        sampler=echo.Uniform(),
        seed=args.seed,
    )


def run_echo(kind: str, args: Any, steps: int, deadline: float) -> dict[str, Any]:
    """Fill a sequence table, then time ``sample()`` against memcpy."""
    length, period, bsz = args.length, args.period, args.batch_size
    frames = Frames(kind, args.frame_pool, args.seed)
    episodes = Episodes(args.streams, args.min_episode, args.max_episode, args.seed)
    nbytes = bsz * length * step_bytes(kind)
    src = np.random.default_rng(3).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    dst[:] = src
    t_made = time.perf_counter()
    server = sequence_server(kind, args, steps)
    guard = h.call_later(max(1.0, deadline - time.perf_counter()) + 30, server.close)
    out: dict[str, Any] = {"kind": kind, "step_bytes": step_bytes(kind)}
    out["construct_s"] = time.perf_counter() - t_made
    try:
        fill_deadline = time.perf_counter() + args.fill_seconds
        out["fill"] = fill_echo(
            server, kind, steps, args.streams, episodes, frames, min(deadline, fill_deadline)
        )
        st = server.stats()
        stored = int(st.steps_stored)
        out["stats"] = {
            "steps_stored": stored,
            "windows": int(st.store_size),
            "windows_inserted_total": int(st.windows_inserted_total),
            "steps_evicted_total": int(st.steps_evicted_total),
        }
        errors: list[str] = []
        sample_ns: list[int] = []
        copy_ns: list[int] = []
        checked = 0
        sink = 0
        n_max = args.batches
        t_end = time.perf_counter() + args.seconds
        s: Any = None
        for n in range(n_max + 2):  # 2 untimed warm-up batches
            s = None
            t0 = time.perf_counter_ns()
            s = server.sample(timeout=SAMPLE_TIMEOUT_S)
            t1 = time.perf_counter_ns()
            if s is None:
                errors.append("sample() returned None (closed by the guard)")
                break
            for leaf in s.batch.values():
                sink += touch(leaf)
            sink += touch(s.mask)
            last = n == n_max + 1 or time.perf_counter() >= t_end or time.perf_counter() > deadline
            if n < 3 or last:
                problem = check_echo_batch(
                    s, episodes=episodes, frames=frames, length=length, period=period,
                    full_check=True,
                )  # fmt: skip
                checked += 1
                if problem:
                    errors.append(f"batch {n}: {problem}")
            t2 = time.perf_counter_ns()
            np.copyto(dst, src)
            t3 = time.perf_counter_ns()
            sink += touch(dst)
            if n >= 2:
                sample_ns.append(t1 - t0)
                copy_ns.append(t3 - t2)
            if last:
                break
        s = None
    finally:
        guard.cancel()
        server.close()
    out["echo"] = {**timing(sample_ns, nbytes), "checked_batches": checked}
    out["echo"]["correct"] = not errors and len(sample_ns) > 0 and checked >= 2
    out["echo"]["errors"] = errors[:5]
    out["memcpy"] = {**timing(copy_ns, nbytes), "correct": len(copy_ns) > 0}
    out["_sink"] = sink % 7
    return out


def run_seq_memory(kind: str, args: Any, steps: int, deadline: float) -> dict[str, Any]:
    """Resident bytes per stored step of a sequence table (run in a fresh process, so that
    no memory freed by an earlier phase is reused and hidden from the RSS)."""
    frames = Frames(kind, args.frame_pool, args.seed)
    episodes = Episodes(args.streams, args.min_episode, args.max_episode, args.seed)
    gc.collect()
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    server = sequence_server(kind, args, steps)
    construct_s = time.perf_counter() - t0
    try:
        rss_made = rss_bytes()
        fill = fill_echo(server, kind, steps, args.streams, episodes, frames, deadline)
        gc.collect()
        rss_filled = rss_bytes()
        stored = int(server.stats().steps_stored)
        s = server.sample(timeout=SAMPLE_TIMEOUT_S)
        ok = s is not None
        s = server.sample(timeout=SAMPLE_TIMEOUT_S)  # both halves of the batch area
        ok = ok and s is not None
        s = None
        rss_sampled = rss_bytes()
    finally:
        server.close()
    own = step_bytes(kind)
    per_step = (rss_filled - rss0) / stored if stored else float("nan")
    return {
        "steps_stored": stored,
        "max_size": steps,
        "step_bytes": own,
        "bytes_per_step": per_step,
        "ratio_to_step_bytes": per_step / own,
        "bytes_per_step_after_sampling": (rss_sampled - rss0) / stored if stored else None,
        "construct_rss_bytes": rss_made - rss0,
        "construct_s": construct_s,
        "fill_rss_bytes": rss_filled - rss_made,
        "sampling_rss_bytes": rss_sampled - rss_filled,
        "fill_wall_s": fill["wall_s"],
        "correct": ok and stored > 0,
    }


def run_alt_memory(kind: str, args: Any, steps: int, deadline: float) -> dict[str, Any]:
    """Resident bytes per step when whole windows are the samples of a replay table."""
    import echo

    length, period = args.length, args.period
    n_windows = max(1, steps // period)
    frames = Frames(kind, args.frame_pool, args.seed)
    window = {name: np.zeros((length, *shape), dt) for name, shape, dt in KINDS[kind]}
    gc.collect()
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    server = echo.Server(
        window, batch_size=args.batch_size, sampler=echo.Uniform(), max_size=n_windows,
        seed=args.seed,
    )  # fmt: skip
    construct_s = time.perf_counter() - t0
    rows_per_call = 8
    try:
        rss_made = rss_bytes()
        done = 0
        while done < n_windows:
            n = min(rows_per_call, n_windows - done)
            # window w covers steps w * period .. + length of stream 0 (as a worker's
            # TrajectoryAccumulator would send them, overlapping by length - period)
            first = (done + np.arange(n, dtype=np.int64)) * period
            ids = (first[:, None] + np.arange(length)).reshape(-1)
            rows = frames.rows(ids)
            tree = {k: v.reshape(n, length, *v.shape[1:]) for k, v in rows.items()}
            server.submit_batch(tree, timeout=SAMPLE_TIMEOUT_S)
            done += n
            if time.perf_counter() > deadline:
                break
        gc.collect()
        rss1 = rss_bytes()
        s = server.sample(timeout=SAMPLE_TIMEOUT_S)
        ok = s is not None and bool(np.all(np.diff(np.asarray(s.batch["action"]), axis=1) == 1))
        s = None
        stored = int(server.stats().store_size)
    finally:
        server.close()
    covered = stored * period  # distinct steps the stored windows cover (overlaps aside)
    per_step = (rss1 - rss0) / covered if covered else float("nan")
    return {
        "windows": stored,
        "window_bytes": length * step_bytes(kind),
        "steps_covered": covered,
        "copies_per_step": length / period,
        "bytes_per_step": per_step,
        "ratio_to_step_bytes": per_step / step_bytes(kind),
        "computed_bytes_per_step": length / period * step_bytes(kind),
        "construct_rss_bytes": rss_made - rss0,
        "construct_s": construct_s,
        "correct": ok and stored == done,
    }


# --------------------------------------------------------------------------- numpy, torchrl


def timed_batches(
    sample: Callable[[], Any],
    consume: Callable[[Any], int],
    batches: int,
    seconds: float,
    deadline: float,
) -> tuple[list[int], list[Any], int]:
    """Times ``sample()`` for up to ``batches`` calls or ``seconds`` (after 2 untimed ones);
    returns the times, the first and last batch (for checks) and the consumer's sink."""
    ns: list[int] = []
    kept: list[Any] = []
    sink = 0
    t_end = time.perf_counter() + seconds
    for n in range(batches + 2):
        t0 = time.perf_counter_ns()
        got = sample()
        t1 = time.perf_counter_ns()
        sink += consume(got)
        last = n == batches + 1 or time.perf_counter() >= t_end or time.perf_counter() > deadline
        if n == 0 or last:
            kept.append(got)
        if n >= 2:
            ns.append(t1 - t0)
        if last:
            break
    return ns, kept, sink


def run_numpy(kind: str, args: Any, steps: int, deadline: float) -> dict[str, Any]:
    """The same steps in flat arrays, windows gathered by fancy indexing and by np.take."""
    length, period, bsz = args.length, args.period, args.batch_size
    frames = Frames(kind, args.frame_pool, args.seed)
    episodes = Episodes(args.streams, args.min_episode, args.max_episode, args.seed)
    per = steps // args.streams
    for k in range(args.streams):  # replay the episode draws up to `per` steps
        for t in range(per):
            episodes.ends_at(k, t)
    tables = flat_tables(kind, steps, args.streams, frames)
    starts = flat_window_starts(steps, args.streams, episodes, length, period)
    rng = np.random.default_rng([args.seed, 4])
    ar = np.arange(length)
    nbytes = bsz * length * step_bytes(kind)
    out: dict[str, Any] = {"windows": len(starts)}
    if len(starts) == 0:
        return {"numpy_fancy": {"correct": False, "error": "no full window"}}

    def fancy() -> dict[str, np.ndarray]:
        idx = starts[rng.integers(0, len(starts), bsz)]
        rows = idx[:, None] + ar
        return {name: arr[rows] for name, arr in tables.items()}

    bufs = {name: np.empty((bsz * length, *a.shape[1:]), a.dtype) for name, a in tables.items()}
    for b in bufs.values():
        b.fill(0)

    def take() -> dict[str, np.ndarray]:
        idx = starts[rng.integers(0, len(starts), bsz)]
        rows = (idx[:, None] + ar).reshape(-1)
        for name, arr in tables.items():
            np.take(arr, rows, axis=0, out=bufs[name], mode="clip")
        return {n: b.reshape(bsz, length, *b.shape[1:]) for n, b in bufs.items()}

    def consume(batch: dict[str, np.ndarray]) -> int:
        return sum(touch(v) for v in batch.values())

    for name, fn in (("numpy_fancy", fancy), ("numpy_take", take)):
        ns, kept, _ = timed_batches(fn, consume, args.batches, args.seconds, deadline)
        ok = all(
            check_flat_windows(b["action"], episodes, length)
            and np.array_equal(obs_stamps(b["obs"]), b["action"])
            for b in kept
        )
        out[name] = {**timing(ns, nbytes), "correct": ok and len(ns) > 0}
    return out


def torchrl_child(kind: str, args: Any, steps: int, deadline: float) -> dict[str, Any]:
    """In the torchrl interpreter: ReplayBuffer + SliceSampler over LazyTensorStorage."""
    import tensordict
    import torch
    import torchrl
    from torchrl.data import LazyTensorStorage, ReplayBuffer, SliceSampler

    length, bsz = args.length, args.batch_size
    frames = Frames(kind, args.frame_pool, args.seed)
    episodes = Episodes(args.streams, args.min_episode, args.max_episode, args.seed)
    per = steps // args.streams
    for k in range(args.streams):
        for t in range(per):
            episodes.ends_at(k, t)
    episode_ids = torch.from_numpy(flat_episode_ids(steps, args.streams, episodes))
    n = len(episode_ids)
    rb = ReplayBuffer(
        storage=LazyTensorStorage(n),
        sampler=SliceSampler(slice_len=length, traj_key="episode", cache_values=True),
        batch_size=bsz * length,
    )
    t0 = time.perf_counter()
    for lo, rows in flat_chunks(kind, steps, args.streams, frames):
        m = len(rows["action"])
        chunk = {k: torch.from_numpy(v) for k, v in rows.items()}
        chunk["episode"] = episode_ids[lo : lo + m]
        rb.extend(tensordict.TensorDict(chunk, batch_size=[m]))
    fill_s = time.perf_counter() - t0
    gc.collect()
    nbytes = bsz * length * step_bytes(kind)

    def consume(td: Any) -> int:
        return sum(touch(td[name].numpy()) for name, _, _ in KINDS[kind])

    ns, kept, _ = timed_batches(rb.sample, consume, args.batches, args.seconds, deadline)
    ok = True
    for td in kept:
        action = td["action"].numpy().reshape(bsz, length)
        ep = td["episode"].numpy().reshape(bsz, length)
        ok = ok and check_flat_windows(action, episodes, length)
        ok = ok and bool(np.all(ep == ep[:, :1]))
        obs = td["obs"].numpy().reshape(bsz, length, -1)
        ok = ok and np.array_equal(obs_stamps(obs), action)
    return {
        **timing(ns, nbytes),
        "correct": ok and len(ns) > 0,
        "fill_s": fill_s,
        "sampler": "SliceSampler(slice_len, traj_key='episode', cache_values=True)",
        "versions": {
            "torch": torch.__version__,
            "torchrl": torchrl.__version__,
            "tensordict": tensordict.__version__,
        },
        "torch_num_threads": torch.get_num_threads(),
    }


def run_child(
    python: str, role: str, kind: str, args: Any, steps: int, deadline: float
) -> dict[str, Any]:
    """Runs this file under ``python`` as ``--child ROLE:KIND``; its record, or the error."""
    left = deadline - time.perf_counter()
    if left < 10:
        return {"skipped": "no time left", "correct": False}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "child.json"
        cmd = [
            python, "-m", "benches.suites.sequence_tables", "--child", f"{role}:{kind}",
            "--json", str(path), "--max-seconds", str(int(left)),
            *(f"--{k.replace('_', '-')}={v}" for k, v in child_params(args, kind, steps).items()),
        ]  # fmt: skip
        try:
            proc = subprocess.run(cmd, cwd=h.ROOT, timeout=left, check=False)
            doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        except (subprocess.SubprocessError, OSError, ValueError) as e:
            return {"error": f"{role}: {type(e).__name__}: {e}", "correct": False}
    if proc.returncode != 0:
        doc.setdefault("exit_status", proc.returncode)
    return doc


def child_params(args: Any, kind: str, steps: int) -> dict[str, Any]:
    return {
        "steps" if kind == "atari" else "small_steps": steps,
        "streams": args.streams,
        "batch_size": args.batch_size,
        "length": args.length,
        "period": args.period,
        "batches": args.batches,
        "seconds": args.seconds,
        "min_episode": args.min_episode,
        "max_episode": args.max_episode,
        "frame_pool": args.frame_pool,
        "seed": args.seed,
    }


# --------------------------------------------------------------------------- the run

PARTS = ("sample", "tcp")
CHILDREN: dict[str, Callable[[str, Any, int, float], dict[str, Any]]] = {
    "seq-memory": run_seq_memory,
    "alt-memory": run_alt_memory,
    "torchrl": torchrl_child,
}


def summarize(kind: str, r: dict[str, Any]) -> dict[str, Any]:
    """Ratios and the issue's targets (reported, not enforced)."""

    def ratio(a: str, b: str, key: str = "p50_ms") -> float | None:
        x, y = r.get(a, {}).get(key), r.get(b, {}).get(key)
        return y / x if x and y else None  # time ratio b/a: how many times faster a is

    memcpy_share = None
    e, m = r.get("echo", {}), r.get("memcpy", {})
    if e.get("gb_per_s") and m.get("gb_per_s"):
        memcpy_share = e["gb_per_s"] / m["gb_per_s"]
    vs_fancy = ratio("echo", "numpy_fancy")
    vs_take = ratio("echo", "numpy_take")
    vs_torchrl = ratio("echo", "torchrl")
    mem = r.get("memory", {}).get("ratio_to_step_bytes")
    need = 5.0 if kind == "small" else 1.0
    return {
        "echo_share_of_memcpy_bw": memcpy_share,
        "echo_speedup_vs_numpy_fancy": vs_fancy,
        "echo_speedup_vs_numpy_take": vs_take,
        "echo_speedup_vs_torchrl": vs_torchrl,
        "memory_ratio": mem,
        "targets": {
            "assembly_ge_50pct_memcpy": None if memcpy_share is None else memcpy_share >= 0.5,
            f"ahead_of_numpy_fancy_ge_{need:g}x": None if vs_fancy is None else vs_fancy >= need,
            "memory_le_1.1x": None if mem is None else mem <= 1.1,
        },
    }


def print_table(label: str, params: dict[str, Any], results: dict[str, Any]) -> None:
    print(label)
    print(
        f"# batch {params['batch_size']} windows x T={params['length']}, period "
        f"{params['period']}, {params['streams']} streams, episodes "
        f"{params['min_episode']}-{params['max_episode']} steps"
    )
    rows: list[list[object]] = [
        ["step", "method", "steps", "batches", "p50 ms", "p99 ms", "GB/s", "echo x faster"]
    ]
    for kind, r in results.items():
        steps = r.get("stats", {}).get("steps_stored", r.get("steps"))
        for name in ("echo", "memcpy", "numpy_fancy", "numpy_take", "torchrl"):
            v = r.get(name)
            if not isinstance(v, dict):
                continue
            if "p50_ms" not in v:
                why = v.get("skipped") or v.get("error") or "no result"
                rows.append([kind, name, "", "", "", "", "", f"({why})"])
                continue
            faster = "" if name == "echo" else h.fmt_ratio(v["p50_ms"], r["echo"].get("p50_ms"), 0)
            bad = "" if v.get("correct", True) else "  NOT CORRECT"
            rows.append([
                kind, name, f"{steps:,}" if steps else "", v["batches"],
                f"{v['p50_ms']:.2f}", f"{v['p99_ms']:.2f}", f"{v['gb_per_s']:.2f}",
                faster.strip() + bad,
            ])  # fmt: skip
    h.print_columns(rows)
    print()
    mrows: list[list[object]] = [
        ["step", "step B", "seq B/step", "ratio", "window-replay B/step", "ratio", "fill steps/s"]
    ]
    for kind, r in results.items():
        mem, alt, fill = r.get("memory", {}), r.get("alt_window_replay", {}), r.get("fill", {})
        mrows.append([
            kind, r.get("step_bytes", ""),
            h.fmt_num(mem.get("bytes_per_step"), ",.0f", 0).strip(),
            h.fmt_num(mem.get("ratio_to_step_bytes"), ".3f", 0).strip(),
            h.fmt_num(alt.get("bytes_per_step"), ",.0f", 0).strip(),
            h.fmt_num(alt.get("ratio_to_step_bytes"), ".3f", 0).strip(),
            h.fmt_num(fill.get("steps_per_s"), ",.0f", 0).strip(),
        ])  # fmt: skip
    h.print_columns(mrows)
    for kind, r in results.items():
        s = r.get("summary", {})
        share = s.get("echo_share_of_memcpy_bw")
        print(
            f"{kind}: echo at {h.fmt_num(share and share * 100, '.0f', 0).strip()}% of memcpy "
            f"bandwidth; targets: " + ", ".join(f"{k}={v}" for k, v in s.get("targets", {}).items())
        )


def parse(argv: list[str] | None) -> Any:
    p = h.bench_parser(__doc__, "1e5 Atari steps, 30 batches", max_seconds=0)
    p.add_argument("--out", dest="json", type=Path, help="same as --json")
    p.add_argument("--kinds", default="atari,small", help="step kinds: atari, small")
    p.add_argument(
        "--steps",
        type=h.bounded_int("--steps", MAX_STEPS),
        default=None,
        help="Atari steps stored (1e6; --quick 1e5)",
    )
    p.add_argument(
        "--small-steps",
        type=h.bounded_int("--small-steps", MAX_STEPS),
        default=None,
        help="256-byte steps stored (1e6; --quick 1e5)",
    )
    p.add_argument(
        "--alt-steps",
        type=h.bounded_int("--alt-steps", MAX_STEPS),
        default=None,
        help="steps the window-replay memory comparison covers (2e5; quick 2e4)",
    )
    p.add_argument("--streams", type=h.bounded_int("--streams", 4096), default=32)
    p.add_argument("--batch-size", type=h.bounded_int("--batch-size", 4096), default=64)
    p.add_argument("--length", type=h.bounded_int("--length", 10_000), default=80)
    p.add_argument("--period", type=h.bounded_int("--period", 10_000), default=40)
    p.add_argument("--min-episode", type=h.bounded_int("--min-episode", 10**6), default=100)
    p.add_argument("--max-episode", type=h.bounded_int("--max-episode", 10**6), default=2000)
    p.add_argument("--frame-pool", type=h.bounded_int("--frame-pool", 1 << 16), default=1024)
    p.add_argument(
        "--batches",
        type=h.bounded_int("--batches", MAX_BATCHES),
        default=None,
        help="timed batches per method (300; --quick 30)",
    )
    p.add_argument(
        "--seconds", type=float, default=None, help="time limit per timed method (10; --quick 2)"
    )
    p.add_argument("--fill-seconds", type=float, default=900.0, help="time limit per fill")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--torchrl-python",
        default=None,
        help="an interpreter with torchrl: compare with its SliceSampler",
    )
    p.add_argument(
        "--parts",
        default="sample,tcp",
        help="what to measure: sample (in-process sample(), numpy, memory, torchrl), tcp",
    )
    p.add_argument(
        "--tcp-kinds", default=None, help="step kinds of the tcp part (--kinds; --quick: small)"
    )
    p.add_argument(
        "--tcp-workers",
        type=h.bounded_int("--tcp-workers", 256),
        default=None,
        help="worker processes of the tcp part (16; --quick 4)",
    )
    p.add_argument(
        "--tcp-seconds", type=float, default=None, help="tcp measuring window (5; --quick 2)"
    )
    p.add_argument(
        "--tcp-warmup", type=float, default=None, help="tcp warm-up before it (1.5; --quick 0.5)"
    )
    p.add_argument(
        "--tcp-pairs",
        type=h.bounded_int("--tcp-pairs", 100),
        default=None,
        help="rounds of steps and of samples, alternating, per kind and path (2; --quick 1)",
    )
    p.add_argument(
        "--tcp-max-size",
        type=h.bounded_int("--tcp-max-size", MAX_STEPS),
        default=65_536,
        help="max_size of the tcp part's tables (steps, samples)",
    )
    p.add_argument(
        "--tcp-no-consumer",
        dest="tcp_consumer",
        action="store_false",
        help="no consumer thread sampling during the tcp rounds",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # ROLE:KIND
    args = p.parse_args(argv)  # fmt: skip
    q = args.quick
    args.steps = args.steps or (100_000 if q else 1_000_000)
    args.small_steps = args.small_steps or (100_000 if q else 1_000_000)
    args.alt_steps = args.alt_steps or (20_000 if q else 200_000)
    args.batches = args.batches or (30 if q else 300)
    args.seconds = args.seconds or (2.0 if q else 10.0)
    args.max_seconds = args.max_seconds or (300.0 if q else 1800.0)
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    for k in args.kinds:
        if k not in KINDS:
            p.error(f"--kinds: unknown step kind {k!r} (known: {', '.join(KINDS)})")
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    for x in args.parts:
        if x not in PARTS:
            p.error(f"--parts: unknown part {x!r} (known: {', '.join(PARTS)})")
    if args.tcp_kinds is None:
        args.tcp_kinds = [k for k in args.kinds if k == "small" or not q] or args.kinds[:1]
    else:
        args.tcp_kinds = [k.strip() for k in args.tcp_kinds.split(",") if k.strip()]
    for k in args.tcp_kinds:
        if k not in KINDS:
            p.error(f"--tcp-kinds: unknown step kind {k!r} (known: {', '.join(KINDS)})")
    args.tcp_workers = args.tcp_workers or (4 if q else 16)
    args.tcp_seconds = args.tcp_seconds or (2.0 if q else 5.0)
    args.tcp_warmup = args.tcp_warmup if args.tcp_warmup is not None else (0.5 if q else 1.5)
    args.tcp_pairs = args.tcp_pairs or (1 if q else 2)
    if not 0 < args.tcp_seconds <= 600 or not 0 <= args.tcp_warmup <= 600:
        p.error("--tcp-seconds must be in (0, 600], --tcp-warmup in [0, 600]")
    if args.min_episode > args.max_episode:
        p.error("--min-episode must not exceed --max-episode")
    if not 0 < args.seconds <= 600:
        p.error("--seconds must be in (0, 600]")
    for name in () if args.child else ("steps", "small_steps"):
        if getattr(args, name) < args.streams * args.length:
            p.error(f"--{name.replace('_', '-')} must be at least streams * length")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    watchdog = h.start_watchdog(args.max_seconds, "bench_sequence")
    deadline = time.perf_counter() + args.max_seconds - 5
    try:
        if args.child:
            role, _, kind = args.child.partition(":")
            steps = args.steps if kind == "atari" else args.small_steps
            doc = CHILDREN[role](kind, args, steps, deadline)
            h.write_json(args.json, doc, say=False)
            return 0 if doc.get("correct") else 1
        return run_all(args, deadline)
    finally:
        watchdog.cancel()


def run_all(args: Any, deadline: float) -> int:
    import echo

    label = h.default_label(args.label, echo)
    load_before = h.loadavg()
    results: dict[str, dict[str, Any]] = {}
    for kind in args.kinds if "sample" in args.parts else []:
        steps = args.steps if kind == "atari" else args.small_steps
        log(f"{kind}: echo, {steps:,} steps of {step_bytes(kind)} B")
        r = run_echo(kind, args, steps, deadline)
        r.pop("_sink", None)
        gc.collect()
        log(f"{kind}: numpy")
        r.update(run_numpy(kind, args, steps, deadline))
        gc.collect()
        log(f"{kind}: sequence table memory (child process)")
        r["memory"] = run_child(sys.executable, "seq-memory", kind, args, steps, deadline)
        alt = min(args.alt_steps, steps)
        log(f"{kind}: window replay memory, {alt:,} steps (child process)")
        r["alt_window_replay"] = run_child(sys.executable, "alt-memory", kind, args, alt, deadline)
        if args.torchrl_python:
            log(f"{kind}: torchrl (child process)")
            r["torchrl"] = run_child(args.torchrl_python, "torchrl", kind, args, steps, deadline)
        else:
            r["torchrl"] = {"skipped": "no --torchrl-python given"}
        r["summary"] = summarize(kind, r)
        results[kind] = r
    tcp: dict[str, Any] | None = None
    if "tcp" in args.parts:
        tcp = run_tcp(args, deadline)
    params = {
        "kinds": args.kinds,
        "steps": args.steps,
        "small_steps": args.small_steps,
        "alt_steps": args.alt_steps,
        "streams": args.streams,
        "batch_size": args.batch_size,
        "length": args.length,
        "period": args.period,
        "at_end": "pad",
        "sampler": "Uniform",
        "min_episode": args.min_episode,
        "max_episode": args.max_episode,
        "frame_pool": args.frame_pool,
        "batches": args.batches,
        "seconds": args.seconds,
        "seed": args.seed,
        "torchrl_python": args.torchrl_python,
        "parts": args.parts,
        "tcp_kinds": args.tcp_kinds,
        "tcp_workers": args.tcp_workers,
        "tcp_seconds": args.tcp_seconds,
        "tcp_warmup": args.tcp_warmup,
        "tcp_tail": TCP_TAIL_S,
        "tcp_pairs": args.tcp_pairs,
        "tcp_max_size": args.tcp_max_size,
        "tcp_episode": list(TCP_EPISODE),
        "tcp_consumer": args.tcp_consumer,
    }
    correct = all(
        v.get("correct") is True
        for r in results.values()
        for v in r.values()
        if isinstance(v, dict) and "correct" in v
    )
    if tcp is not None:
        correct = (
            correct
            and not tcp["workers_forced"]
            and all(
                r[path]["correct"]
                for r in tcp.values()
                if isinstance(r, dict)
                for path in TCP_PATHS
            )
        )
    if results:
        print_table(h.run_title(label, echo), params, results)
    else:
        print(h.run_title(label, echo))
    if tcp is not None:
        print()
        print_tcp(tcp, params)
    log(f"correct {correct}")
    if args.json is not None:
        doc = {
            **h.run_facts(label, echo),
            "benchmark": "sequence",
            "echo_build": h.echo_build(echo),
            "quick": args.quick,
            "loadavg_before": load_before,
            "loadavg_after": h.loadavg(),
            "params": params,
            "results": results,
            "tcp": tcp,
            "correct": correct,
        }
        h.write_json(args.json, doc)
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
