"""One part of the ``ragged`` suite (``benches/suites/ragged.py``), in a process of its own::

    PYTHON -m benches.suites.ragged_child PART PARAMS_JSON --json OUT

from the repository root. PART is one of:

- ``memory`` (echo): RSS and arena bytes of a replay table filled with ``fill`` rollouts,
  against their payload and against the same rollouts padded to ``max_len``.
- ``ingest`` (echo): ``submit()`` from 1 and more threads into a FIFO server with ragged
  leaves and into one with a single fixed ``uint8`` leaf of the rollouts' mean bytes, a
  consumer thread reading every byte of every batch in both.
- ``tcp`` (echo): the same two servers fed by ``tcp_workers`` worker processes, each an
  ``echo.TcpClient`` on loopback, a learner reading every batch
  (``benches/suites/ragged_tcp.py``).
- ``sample`` (echo): packed FIFO batches, packed and padded replay batches (token budget
  ``batch_tokens`` of the completion), each read in full, against ``np.copyto`` of as many
  bytes.
- ``echo_peer``, ``torchrl``, ``transferqueue``: the peer comparison's rows, the same for
  every library: insert the rollouts one at a time into a table of ``peer_fill``, then
  batches of ``peer_batch`` rollouts, read in full. ``torchrl`` and ``transferqueue`` run in
  those libraries' virtualenvs (``benches/suites/ragged.py`` makes them) and import no echo.

Every part imports numpy, ``benches.common`` and ``benches.suites.ragged_data`` (numpy and the
standard library), and its library. Every loop is bounded in count and time, and a watchdog
ends the process past ``child_timeout``. Writes the part's result (``correct`` among it) as
JSON to OUT, or ``{"error": ...}``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import threading
import time
from typing import Any

import numpy as np

from benches import common as c
from benches.suites.ragged_data import Memcpy, Rollouts, touch

MIB = 1 << 20


def _rss_bytes() -> int:
    return c.status_kib("VmRSS")["VmRSS"] * 1024


def _example(echo: Any, p: dict[str, Any]) -> dict[str, Any]:
    return {
        "prompt": echo.Ragged(int(p["prompt_max"]), np.int32),
        "tokens": echo.Ragged(int(p["completion_max"]), np.int32, group="completion"),
        "logp": echo.Ragged(int(p["completion_max"]), np.float32, group="completion"),
        "reward": np.zeros((), np.float32),
    }


def _batch_arrays(batch: dict[str, Any]) -> list[Any]:
    """The arrays of a batch a learner reads: each ragged leaf's values, the fixed leaves."""
    return [
        v.values if hasattr(v, "values") and not isinstance(v, np.ndarray) else v
        for v in (batch["prompt"], batch["tokens"], batch["logp"], batch["reward"])
    ]


def _check_packed(batch: dict[str, Any], pool: Rollouts) -> bool:
    """Every sample of a packed batch has its rollout's lengths and first token."""
    idx = batch["reward"].astype(np.int64)
    tokens, prompt = batch["tokens"], batch["prompt"]
    ok = np.array_equal(np.diff(tokens.cu_seqlens), pool.completion_len[idx])
    ok = ok and np.array_equal(np.diff(prompt.cu_seqlens), pool.prompt_len[idx])
    ok = ok and np.array_equal(batch["logp"].cu_seqlens, tokens.cu_seqlens)
    if ok and len(idx):
        j = int(idx[-1])
        start = int(tokens.cu_seqlens[-2])
        ok = bool(np.array_equal(tokens.values[start:], pool.tokens[j]))
    return bool(ok)


# --------------------------------------------------------------------------- memory


def part_memory(p: dict[str, Any], log: Any) -> dict[str, Any]:
    import echo

    pool = Rollouts(p)
    n = int(p["fill"])
    gc.collect()
    c.malloc_trim()
    rss0 = _rss_bytes()
    server = echo.Server(
        _example(echo, p),
        batch_size=64,
        sampler=echo.Uniform(),
        max_size=int(p["max_size"]),
        max_bytes=int(p["max_bytes"]),
        seed=0,
    )
    rss_built = _rss_bytes()
    payload = 0
    t0 = time.perf_counter()
    for i in range(n):
        j = i % pool.n
        server.submit(pool.sample(j))
        payload += pool.sample_bytes(j)
    fill_s = time.perf_counter() - t0
    rss1 = c.settle_rss(max_s=3.0) * MIB
    s = server.stats()
    raw, stored = int(s.raw_bytes), int(s.stored_bytes)
    correct = raw == payload and int(s.store_size) == n and int(s.evicted_total) == 0
    if not correct:
        log(
            f"memory: raw {raw} vs payload {payload}, stored {s.store_size} of {n}, "
            f"evicted {s.evicted_total}"
        )
    batch = server.sample(timeout=5.0)
    correct = correct and batch is not None and _check_packed(batch.batch, pool)
    padded = n * pool.padded_bytes()
    server.close()
    del server
    return {
        "samples": n,
        "payload_bytes": payload,
        "raw_bytes": raw,
        "stored_bytes": stored,
        "stored_over_raw": stored / raw,
        "rss_before": rss0,
        "rss_after_build": rss_built,
        "rss_after_fill": int(rss1),
        "rss_growth": int(rss1 - rss0),
        "rss_growth_over_payload": (rss1 - rss0) / payload,
        "rss_empty_server": int(rss_built - rss0),
        "rss_fill": int(rss1 - rss_built),
        "rss_fill_over_payload": (rss1 - rss_built) / payload,
        "padded_bytes": padded,
        "padded_over_payload": padded / payload,
        "fill_samples_per_s": n / fill_s,
        "fill_gb_per_s": payload / fill_s / 1e9,
        "correct": bool(correct),
    }


# --------------------------------------------------------------------------- ingest


def _ingest_once(
    echo: Any, p: dict[str, Any], pool: Rollouts, kind: str, fixed: list[Any], threads: int
) -> dict[str, Any]:
    """``threads`` writers submit the pool's rollouts (``kind`` ragged), payloads of their
    mean size (fixed) or the rollouts' leaves at fixed mean lengths (leaves) for
    ``ingest_seconds`` into a FIFO server of batches of ``ingest_batch``; a consumer thread
    reads every byte of every batch (and checks the ragged ones)."""
    batch_size = int(p["ingest_batch"])
    if kind == "ragged":
        server = echo.Server(_example(echo, p), batch_size=batch_size)
        items = [pool.sample(i) for i in range(pool.n)]
        sizes = [pool.sample_bytes(i) for i in range(pool.n)]
    elif kind == "leaves":
        items = pool.fixed_leaves()
        server = echo.Server({k: np.zeros_like(v) for k, v in items[0].items()}, batch_size)
        sizes = [sum(int(v.nbytes) for v in item.values()) for item in items]
    else:
        server = echo.Server({"payload": np.zeros(fixed[0].shape, np.uint8)}, batch_size)
        items = [{"payload": a} for a in fixed]
        sizes = [a.nbytes for a in fixed]
    seconds = float(p["ingest_seconds"])
    cap = int(p["max_samples"])
    counts = [0] * threads
    nbytes = [0] * threads
    errors: list[str] = []
    consumed = {"samples": 0, "bytes": 0, "batches": 0, "bad": 0, "acc": 0}
    start = threading.Barrier(threads + 1)

    def writer(w: int) -> None:
        submit = server.submit
        j = w * len(items) // threads
        k = b = 0
        try:
            start.wait()
            deadline = time.perf_counter() + seconds
            while k < cap and time.perf_counter() < deadline:
                submit(items[j], timeout=30.0)
                b += sizes[j]
                k += 1
                j = j + 1 if j + 1 < len(items) else 0
        except Exception as e:  # noqa: BLE001  reported
            errors.append(f"writer {w}: {type(e).__name__}: {e}")
        counts[w], nbytes[w] = k, b

    def consumer() -> None:
        try:
            while (s := server.sample(timeout=60.0)) is not None:
                batch = s.batch
                if kind == "ragged":
                    arrays = _batch_arrays(batch)
                    if not _check_packed(batch, pool):
                        consumed["bad"] += 1
                elif kind == "leaves":
                    arrays = [batch[k] for k in ("prompt", "tokens", "logp", "reward")]
                else:
                    arrays = [batch["payload"]]
                consumed["acc"] ^= touch(arrays)
                consumed["bytes"] += sum(np.asarray(a).nbytes for a in arrays)
                consumed["samples"] += s.num_samples
                consumed["batches"] += 1
        except Exception as e:  # noqa: BLE001  reported
            errors.append(f"consumer: {type(e).__name__}: {e}")

    ws = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(threads)]
    cons = threading.Thread(target=consumer, daemon=True)
    cons.start()
    for t in ws:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in ws:
        t.join(seconds + 60.0)
    dt = time.perf_counter() - t0
    server.close(drain=True)
    cons.join(60.0)
    submitted, sent = sum(counts), sum(nbytes)
    # A fixed-shape FIFO server's close(drain=True) hands out full batches only (it drops the
    # last partial one, and says so); a ragged one hands out what is left.
    want = submitted if kind == "ragged" else submitted // batch_size * batch_size
    correct = not errors and consumed["samples"] == want and consumed["bad"] == 0
    correct = correct and (kind != "ragged" or consumed["bytes"] == sent)
    return {
        "threads": threads,
        "samples": submitted,
        "bytes": sent,
        "seconds": dt,
        "samples_per_s": submitted / dt,
        "gb_per_s": sent / dt / 1e9,
        "consumed_samples": consumed["samples"],
        "consumed_batches": consumed["batches"],
        "bad_batches": consumed["bad"],
        "errors": errors[:3],
        "correct": bool(correct),
    }


def part_ingest(p: dict[str, Any], log: Any) -> dict[str, Any]:
    import echo

    pool = Rollouts(p)
    mean = round(pool.mean_bytes())
    rng = np.random.default_rng(1)
    fixed = [rng.integers(0, 256, mean, dtype=np.uint8) for _ in range(pool.n)]
    out: dict[str, Any] = {"mean_sample_bytes": mean, "runs": {}}
    out["leaves_lengths"] = list(pool.leaves_lengths())
    correct = True
    for rnd in range(int(p["repeats"])):
        for threads in p["threads"]:
            kinds = ("ragged", "fixed", "leaves")
            for kind in kinds[rnd % 3 :] + kinds[: rnd % 3]:
                gc.collect()
                r = _ingest_once(echo, p, pool, kind, fixed, threads)
                log(
                    f"ingest {kind} x{threads} #{rnd + 1}: {r['samples_per_s']:,.0f} samples/s, "
                    f"{r['gb_per_s']:.2f} GB/s{'' if r['correct'] else ' INCORRECT'}"
                )
                correct = correct and r["correct"]
                out["runs"].setdefault(f"{kind}/{threads}", []).append(r)
    best: dict[str, Any] = {}
    for key, runs in out["runs"].items():
        top = max(runs, key=lambda r: r["gb_per_s"])
        best[key] = {k: top[k] for k in ("samples_per_s", "gb_per_s", "samples")}
        best[key]["spread"] = max(r["gb_per_s"] for r in runs) / max(
            1e-12, min(r["gb_per_s"] for r in runs)
        )
    out["best"] = best
    out["correct"] = correct
    return out


def part_tcp(p: dict[str, Any], log: Any) -> dict[str, Any]:
    from benches.suites.ragged_tcp import measure_tcp

    return measure_tcp(p, _check_packed, log)


# --------------------------------------------------------------------------- sampling


def _memcpy(nbytes: float, p: dict[str, Any]) -> dict[str, Any]:
    m = Memcpy(int(nbytes))
    seconds, cap = float(p["seconds"]), int(p["max_calls"])
    count, dt = c.timed_loop(m.copy, seconds, cap)
    count_r, dt_r = c.timed_loop(m.copy_and_touch, seconds, cap)
    return {
        "bytes": m.nbytes,
        "copy_gb_per_s": count * m.nbytes / dt / 1e9,
        "copy_read_gb_per_s": count_r * m.nbytes / dt_r / 1e9,
    }


def _numpy_gather(pool: Rollouts, rows: int, batch_samples: int, p: dict[str, Any]) -> dict:
    """The same gather in numpy: each leaf of ``rows`` rollouts (the replay table's) in one
    flat array, and per batch ``batch_samples`` rollouts drawn uniformly, their rows copied
    with ``np.concatenate(slices, out=)`` into preallocated buffers (and then read)."""
    idx = np.arange(rows) % pool.n
    leaves = []
    for arrays in (pool.prompts, pool.tokens, pool.logps):
        lens = np.array([len(arrays[i]) for i in idx], np.int64)
        offsets = np.zeros(rows + 1, np.int64)
        offsets[1:] = np.cumsum(lens)
        flat = np.concatenate([arrays[i] for i in idx])
        out = np.empty(int(lens.max()) * batch_samples, flat.dtype)
        leaves.append((flat, offsets, out))
    rewards = np.array([pool.rewards[i] for i in idx], np.float32)
    rng = np.random.default_rng(0)
    nbytes = [0]

    def gather(read: bool) -> None:
        pick = rng.integers(0, rows, batch_samples)
        got = [rewards[pick]]
        for flat, offsets, out in leaves:
            parts = [flat[offsets[i] : offsets[i + 1]] for i in pick]
            total = int(sum(len(x) for x in parts))
            np.concatenate(parts, out=out[:total])
            got.append(out[:total])
        nbytes[0] += sum(a.nbytes for a in got)
        if read:
            touch(got)

    seconds, cap = float(p["seconds"]), int(p["max_calls"])
    out: dict[str, Any] = {"batch_samples": batch_samples}
    for key, read in (("copy_gb_per_s", False), ("copy_read_gb_per_s", True)):
        nbytes[0] = 0
        _, dt = c.timed_loop(lambda read=read: gather(read), seconds, cap, warmup=0)
        out[key] = nbytes[0] / dt / 1e9
    return out


def _sample_loop(draw: Any, p: dict[str, Any], pool: Rollouts, padded: bool) -> dict[str, Any]:
    """Calls ``draw()`` (a batch, or None when it has none now) for ``seconds``, timing the
    call alone and the call plus a read of every byte; bytes are those handed out."""
    seconds, cap = float(p["seconds"]), int(p["max_calls"])
    t_sample = t_total = t_view = 0.0
    batches = samples = handed = payload = views = bad = 0
    acc = 0
    deadline = time.perf_counter() + seconds
    while batches < cap and time.perf_counter() < deadline:
        t0 = time.perf_counter()
        s = draw()
        t1 = time.perf_counter()
        if s is None:
            break
        batch = s.batch
        arrays = _batch_arrays(batch)
        acc ^= touch(arrays)
        t2 = time.perf_counter()
        t_sample += t1 - t0
        t_total += t2 - t0
        batches += 1
        samples += s.num_samples
        handed += sum(a.nbytes for a in arrays)
        idx = batch["reward"].astype(np.int64)
        payload += sum(pool.sample_bytes(int(i)) for i in idx)
        if padded:
            lengths = batch["tokens"].lengths
            if not np.array_equal(lengths, pool.completion_len[idx]):
                bad += 1
        else:
            view = not batch["tokens"].values.flags.writeable
            views += int(view)
            t_view += (t1 - t0) if view else 0.0
            if not _check_packed(batch, pool):
                bad += 1
    return {
        "batches": batches,
        "samples": samples,
        "bytes_handed_out": handed,
        "payload_bytes": payload,
        "seconds_in_sample": t_sample,
        "seconds_with_read": t_total,
        "sample_gb_per_s": handed / t_sample / 1e9 if t_sample else None,
        "read_gb_per_s": handed / t_total / 1e9 if t_total else None,
        "payload_gb_per_s": payload / t_total / 1e9 if t_total else None,
        "mean_batch_bytes": handed / batches if batches else None,
        "mean_batch_samples": samples / batches if batches else None,
        "zero_copy_batches": views,
        "seconds_in_view_samples": t_view,
        "us_per_view_sample": t_view / views * 1e6 if views else None,
        "us_per_gathered_sample": (t_sample - t_view) / (batches - views) * 1e6
        if batches > views
        else None,
        "bad_batches": bad,
        "correct": bad == 0 and batches > 0,
    }


def part_sample(p: dict[str, Any], log: Any) -> dict[str, Any]:
    import echo

    pool = Rollouts(p)
    example = _example(echo, p)
    budget, batch_size = int(p["batch_tokens"]), int(p["sample_batch"])
    out: dict[str, Any] = {}

    # FIFO, packed: rounds of a fill (untimed) and a drain (each sample() timed)
    fill = min(pool.n, int(p["fifo_fill"]))
    num_buffers = max(3, -(-(fill + batch_size) // batch_size) + 1)
    fifo = echo.Server(
        example,
        batch_size=batch_size,
        num_buffers=num_buffers,
        batch_tokens=budget,
        token_group="completion",
    )
    rounds: list[dict[str, Any]] = []
    t_end = time.perf_counter() + float(p["seconds"])
    j = 0
    while time.perf_counter() < t_end and len(rounds) < 10_000:
        for _ in range(fill):
            fifo.submit(pool.sample(j))
            j = j + 1 if j + 1 < pool.n else 0

        def draw_fifo() -> Any:
            try:
                return fifo.sample(timeout=0.0)
            except TimeoutError:
                return None

        rounds.append(_sample_loop(draw_fifo, {**p, "seconds": 3600.0}, pool, padded=False))
    fifo.close()
    out["fifo_packed"] = _merge(rounds)

    # replay: one table, packed and padded batches
    table = echo.Server(
        example,
        batch_size=batch_size,
        sampler=echo.Uniform(),
        max_size=int(p["max_size"]),
        max_bytes=int(p["max_bytes"]),
        batch_tokens=budget,
        token_group="completion",
        seed=0,
    )
    for i in range(int(p["replay_fill"])):
        table.submit(pool.sample(i % pool.n))
    out["replay_packed"] = _sample_loop(lambda: table.sample(), p, pool, padded=False)
    multiple = int(p["pad_to_multiple"])
    out["replay_padded"] = _sample_loop(
        lambda: table.sample(layout="padded", pad_to_multiple=multiple), p, pool, padded=True
    )
    out["replay_stored_samples"] = int(table.stats().store_size)
    table.close()
    batch_samples = round(out["replay_packed"]["mean_batch_samples"] or 1)
    out["replay_packed"]["numpy_gather"] = _numpy_gather(
        pool, int(p["replay_fill"]), batch_samples, p
    )
    correct = True
    for name in ("fifo_packed", "replay_packed", "replay_padded"):
        r = out[name]
        r["memcpy"] = _memcpy(r["mean_batch_bytes"] or 8, p)
        r["ratio_read"] = (r["read_gb_per_s"] or 0) / r["memcpy"]["copy_read_gb_per_s"]
        r["ratio_sample"] = (r["sample_gb_per_s"] or 0) / r["memcpy"]["copy_gb_per_s"]
        correct = correct and r["correct"]
        log(
            f"sample {name}: {r['read_gb_per_s'] or 0:.2f} GB/s with the read "
            f"({r['ratio_read']:.2f}x memcpy+read), sample() alone "
            f"{r['sample_gb_per_s'] or 0:.2f} GB/s ({r['ratio_sample']:.2f}x memcpy), "
            f"{r['mean_batch_samples'] or 0:.1f} samples a batch"
        )
    out["correct"] = correct
    return out


def _merge(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The FIFO drain rounds as one run."""
    keys = ("batches", "samples", "bytes_handed_out", "payload_bytes", "zero_copy_batches")
    out: dict[str, Any] = {k: sum(r[k] for r in rounds) for k in keys}
    out["bad_batches"] = sum(r["bad_batches"] for r in rounds)
    out["seconds_in_sample"] = ts = sum(r["seconds_in_sample"] for r in rounds)
    tv = sum(r["seconds_in_view_samples"] for r in rounds)
    views, n = out["zero_copy_batches"], out["batches"]
    out["us_per_view_sample"] = tv / views * 1e6 if views else None
    out["us_per_gathered_sample"] = (ts - tv) / (n - views) * 1e6 if n > views else None
    out["seconds_with_read"] = tt = sum(r["seconds_with_read"] for r in rounds)
    b, n = out["bytes_handed_out"], out["batches"]
    out["sample_gb_per_s"] = b / ts / 1e9 if ts else None
    out["read_gb_per_s"] = b / tt / 1e9 if tt else None
    out["payload_gb_per_s"] = out["payload_bytes"] / tt / 1e9 if tt else None
    out["mean_batch_bytes"] = b / n if n else None
    out["mean_batch_samples"] = out["samples"] / n if n else None
    out["rounds"] = len(rounds)
    out["correct"] = out["bad_batches"] == 0 and n > 0
    return out


# --------------------------------------------------------------------------- peers


def _peer_rows(
    add: Any, draw: Any, p: dict[str, Any], pool: Rollouts, log: Any, name: str
) -> dict[str, Any]:
    """The rows every library runs: ``add(i)`` rollout ``i`` for ``peer_fill`` rollouts (first
    fill, timed), then ``draw()`` batches (each a list of arrays a learner reads, and the
    rewards: the rollouts' indices) for ``seconds``, ``repeats`` times, each read in full."""
    n = int(p["peer_fill"])
    sent = 0
    t0 = time.perf_counter()
    for i in range(n):
        j = i % pool.n
        add(j)
        sent += pool.sample_bytes(j)
    fill_s = time.perf_counter() - t0
    log(f"{name}: added {n:,} rollouts in {fill_s:.2f} s: {n / fill_s:,.0f}/s")
    rates: list[dict[str, float]] = []
    bad = 0
    acc = 0
    for _ in range(int(p["repeats"])):
        batches = samples = nbytes = 0
        t0 = time.perf_counter()
        deadline = t0 + float(p["seconds"])
        while batches < int(p["max_calls"]) and time.perf_counter() < deadline:
            arrays, rewards = draw()
            acc ^= touch(arrays)
            idx = np.asarray(rewards).astype(np.int64).reshape(-1)
            want = sum(pool.sample_bytes(int(i)) for i in idx)
            got = sum(np.asarray(a).nbytes for a in arrays)
            bad += int(got != want or len(idx) != int(p["peer_batch"]))
            batches += 1
            samples += len(idx)
            nbytes += got
        dt = time.perf_counter() - t0
        rates.append({"samples_per_s": samples / dt, "gb_per_s": nbytes / dt / 1e9})
    top = max(rates, key=lambda r: r["samples_per_s"])
    log(f"{name}: sample {top['samples_per_s']:,.0f} samples/s, {top['gb_per_s']:.2f} GB/s")
    return {
        "add_samples_per_s": n / fill_s,
        "add_gb_per_s": sent / fill_s / 1e9,
        "sample_samples_per_s": top["samples_per_s"],
        "sample_gb_per_s": top["gb_per_s"],
        "sample_rounds": rates,
        "bad_batches": bad,
        "correct": bad == 0,
    }


def part_echo_peer(p: dict[str, Any], log: Any) -> dict[str, Any]:
    import echo

    pool = Rollouts(p)
    table = echo.Server(
        _example(echo, p),
        batch_size=int(p["peer_batch"]),
        sampler=echo.Uniform(),
        max_size=int(p["max_size"]),
        max_bytes=int(p["max_bytes"]),
        seed=0,
    )
    items = [pool.sample(i) for i in range(pool.n)]
    submit = table.submit

    def add(j: int) -> None:
        submit(items[j])

    def draw() -> tuple[list[Any], Any]:
        batch = table.sample().batch
        return _batch_arrays(batch), batch["reward"]

    out = _peer_rows(add, draw, p, pool, log, "echo")
    table.close()
    out["versions"] = {"echo": echo.__version__, "numpy": np.__version__}
    out["api"] = {
        "table": "Server(example with Ragged leaves, batch_size, sampler=Uniform(), max_size, "
        "max_bytes)",
        "add": "submit(rollout) (copies into the arena)",
        "sample": "sample() (Packed values + cu_seqlens, gathered)",
    }
    return out


def part_torchrl(p: dict[str, Any], log: Any) -> dict[str, Any]:
    import tensordict
    import torch
    import torchrl
    from tensordict import TensorDict
    from torchrl.data import LazyStackStorage, ReplayBuffer

    torch.set_num_threads(1)
    pool = Rollouts(p)
    # The rollouts as torch tensors (sharing the pool's memory), made before the clock: what a
    # torch-based worker holds.
    tensors = [
        {
            "prompt": torch.from_numpy(pool.prompts[i]),
            "tokens": torch.from_numpy(pool.tokens[i]),
            "logp": torch.from_numpy(pool.logps[i]),
            "reward": torch.from_numpy(pool.rewards[i]),
        }
        for i in range(pool.n)
    ]
    batch = int(p["peer_batch"])
    rb = ReplayBuffer(storage=LazyStackStorage(int(p["max_size"])), batch_size=batch)

    def add(j: int) -> None:
        rb.add(TensorDict(tensors[j], batch_size=[]))

    def draw() -> tuple[list[Any], Any]:
        td = rb.sample()  # a LazyStackedTensorDict of `batch` rollouts
        nested = td.densify(layout=torch.jagged)  # ragged entries as nested (jagged) tensors
        arrays = [nested[k].values() for k in ("prompt", "tokens", "logp")]
        rewards = nested["reward"]
        return [a.numpy() for a in arrays] + [rewards.numpy()], rewards.numpy()

    out = _peer_rows(add, draw, p, pool, log, "torchrl")
    out["versions"] = {
        "torchrl": torchrl.__version__,
        "tensordict": tensordict.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
    }
    out["api"] = {
        "table": "ReplayBuffer(storage=LazyStackStorage(max_size), batch_size)",
        "add": "add(TensorDict(rollout's tensors, batch_size=[])) (keeps references: no copy)",
        "sample": "sample() (a LazyStackedTensorDict), then densify(layout=torch.jagged): "
        "nested tensors whose values() are packed",
    }
    return out


def part_transferqueue(p: dict[str, Any], log: Any) -> dict[str, Any]:
    from benches.suites.ragged_tq import measure_transferqueue

    return measure_transferqueue(p, Rollouts(p), _peer_rows, log)


PARTS = {
    "memory": part_memory,
    "ingest": part_ingest,
    "tcp": part_tcp,
    "sample": part_sample,
    "echo_peer": part_echo_peer,
    "torchrl": part_torchrl,
    "transferqueue": part_transferqueue,
}


def main(argv: list[str] | None = None) -> int:
    import json

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("part", choices=list(PARTS))
    ap.add_argument("params", help="the suite's parameters, JSON")
    ap.add_argument("--json", required=True, help="where the result goes")
    args = ap.parse_args(argv)
    p = json.loads(args.params)
    c.watchdog(float(p["child_timeout"]))
    log = c.logger(f"ragged[{args.part}]")
    head: dict[str, Any] = {"part": args.part, "load_before": c.loadavg()}
    try:
        doc = {**head, **PARTS[args.part](p, log), "load_after": c.loadavg()}
    except ImportError as e:
        doc = {**head, "error": f"not installed: {e}"}
    except Exception as e:  # noqa: BLE001  reported in the record, not lost
        import traceback

        traceback.print_exc()
        doc = {**head, "error": f"{type(e).__name__}: {e}"}
    c.write_json(args.json, doc, say=False)
    return 0 if "error" not in doc else 1


if __name__ == "__main__":
    sys.exit(main())
