"""Durable acknowledgements: samples/s and worker memory of ``TcpClient(durable=True)``
against plain acknowledgements, same learner, same checkpoints.

A durable client keeps every sample it sent until the learner says a checkpoint it completed
holds it (not only until it is acknowledged), and its ``send()`` blocks once the kept samples
fill ``durable_bytes``. Each round is one mode, one example and one checkpoint interval:

* ``plain``: ``TcpClient(..., reconnect=True, shared_memory=False)``, which keeps the
  unacknowledged samples (at most ``max_inflight_msgs``, 32) to resend;
* ``durable N MiB``: ``TcpClient(..., durable=True, durable_bytes=N MiB)``, one round per
  budget in ``budgets_mib`` (64 MiB, which holds what a checkpoint interval accumulates of
  small samples, and 1 MiB, which makes ``send()`` block between checkpoints).

This process (the suite's child) is the learner: ``Server(example, batch_size,
transport=TcpTransport(port=0, host="127.0.0.1"), checkpoint_dir=TMP, checkpoint_every=I,
checkpoint_keep=2)``, started fresh for every round, so each round's checkpoints and each
round's worker processes (peak RSS is per process lifetime) are its own. K worker processes
(this interpreter running this file with ``--worker``) connect, say ``ready``, and on ``go``
send from a common start ``T`` until ``T + warmup + seconds``, each sample drawn in turn from
a pool of ``POOL`` distinct samples (random leaves; element 0 of every ``float32`` leaf holds
the pool index, the ``meta`` leaf ``(worker, seq, 0)``); every 8 sends a worker reads its
``retained_bytes`` (the peak is reported). Then each ``close()``s (a durable client waits
until everything is persisted, so up to a checkpoint interval) and reports what it sent, its
CPU time over the sending, ``durable_waits`` / ``durable_wait_s``, its RSS when connected and
its peak RSS at the end (``VmHWM`` of ``/proc/self/status``: ``getrusage``'s ``ru_maxrss`` of
a process started by ``subprocess`` also holds its parent's peak, the learner's).

The learner calls ``sample()`` all along and reads every batch: the ``meta`` leaf and element
0 of every ``float32`` leaf. Samples whose ``sample()`` returned inside ``[T + warmup, T +
warmup + seconds]`` count for samples/s. Once every worker has reported, the learner
``submit()``s marker samples (worker -1) to complete the last batch and reads until it has
seen every sample sent. ``correct``: every worker's samples arrived exactly once (their ids
are ``0 .. sent - 1``, no duplicate, none missing) and intact, every ``close()`` flushed
(``given_up == 0``), and no worker failed.

Modes run in alternating order from repeat to repeat (plain first, then last, ...), so a busy
moment on a shared machine hits every mode. The table shows, per example, interval and mode,
the medians over the repeats of samples/s, of the per-repeat ratio to plain, of the largest
worker peak RSS and of the largest peak ``retained_bytes``, and the blocked sends and their
seconds (summed over the workers). Every loop is bounded in count and time: workers stop at
their deadline and have a watchdog; the learner closes its server when a round overruns; the
driver kills (by PID) only the workers it started. Loopback only.

Run: ``python -m benches durable [--quick] [--set intervals=[0.5,2.0]] [--set
budgets_mib=[256,1]]``.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benches import common as c
from echo import Server, TcpClient, TcpTransport

ROOT = Path(__file__).resolve().parent.parent.parent
HOST = "127.0.0.1"
POOL = 64  # distinct samples per worker
WINDOW = 32  # max_inflight_msgs
EXAMPLES = {"small": 32, "large": 64}  # name -> batch_size
MARKER = -1.0
POLL_EVERY = 8  # sends between two reads of retained_bytes
READY_TIMEOUT_S = 60.0  # interpreter start-up of the workers on a busy 2-core machine
START_AHEAD_S = 0.3
STALL_S = 10.0
SEND_TIMEOUT_S = 30.0
CLOSE_TIMEOUT_S = 30.0

log = c.logger("durable")


def example(name: str) -> dict[str, Any]:
    """``small``: the wire-versions suite's 21 leaves, 309 bytes; ``large``: 6 leaves,
    65,572 bytes (two observations of 32 and 16 KiB, a 16 KiB next observation, an action, a
    reward and ``meta``)."""
    if name == "small":
        return {
            "obs": {f"o{i:02d}": np.zeros(4, np.float32) for i in range(16)},
            "act": {"a": np.zeros((), np.int64), "b": np.zeros(2, np.int64)},
            "rew": np.zeros((), np.float32),
            "done": np.zeros((), np.bool_),
            "meta": np.zeros(3, np.float64),
        }
    return {
        "obs": {"a": np.zeros(8192, np.float32), "b": np.zeros(4096, np.float32)},
        "next": {"c": np.zeros(4096, np.float32)},
        "act": np.zeros((), np.int64),
        "rew": np.zeros((), np.float32),
        "meta": np.zeros(3, np.float64),
    }


def f32_paths(tree: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The paths of the float32 leaves of a (nested dict) tree, in a fixed order."""
    out: list[tuple[str, ...]] = []
    for key in sorted(tree):
        value = tree[key]
        if isinstance(value, dict):
            out += f32_paths(value, (*prefix, key))
        elif value.dtype == np.float32:
            out.append((*prefix, key))
    return out


def leaf(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def sample_bytes(tree: Any) -> int:
    return sum(sample_bytes(v) if isinstance(v, dict) else int(v.nbytes) for v in tree.values())


def count_leaves(tree: Any) -> int:
    return sum(count_leaves(v) if isinstance(v, dict) else 1 for v in tree.values())


def mode_names(budgets_mib: list[float]) -> list[str]:
    return ["plain", *(f"durable {b:g} MiB" for b in budgets_mib)]


def budget_of(mode: str) -> int | None:
    """``durable_bytes`` of a mode, None for ``plain``."""
    if mode == "plain":
        return None
    return int(float(mode.split()[1]) * c.MIB)


# --------------------------------------------------------------------------- worker


def pool_of(name: str, wid: int) -> list[Any]:
    """``POOL`` distinct samples: random leaves, element 0 of every float32 leaf the index."""
    rng = np.random.default_rng(1000 + wid)
    pool = []
    for i in range(POOL):
        tree = example(name)
        for path in f32_paths(tree):
            arr = leaf(tree, path)
            arr[...] = rng.random(arr.shape, np.float32)
            arr.flat[0] = i
        pool.append(tree)
    return pool


def connect(port: int, tree: Any, budget: int | None) -> TcpClient:
    if budget is None:
        return TcpClient(
            HOST, port, tree, max_inflight_msgs=WINDOW, reconnect=True, shared_memory=False
        )
    return TcpClient(
        HOST,
        port,
        tree,
        max_inflight_msgs=WINDOW,
        shared_memory=False,
        durable=True,
        durable_bytes=budget,
    )


def worker_main(argv: list[str]) -> int:
    """``--worker PORT EXAMPLE WID BUDGET`` (BUDGET ``0``: plain): one connection, one go."""
    port, name, wid, budget_arg = int(argv[0]), argv[1], int(argv[2]), int(argv[3])
    budget = budget_arg or None
    c.start_watchdog(600.0, f"durable worker {wid}")

    def say(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    pool = pool_of(name, wid)
    report: dict[str, Any] = {"wid": wid, "sent": 0, "error": None}
    try:
        client = connect(port, pool[0], budget)
    except Exception as e:  # noqa: BLE001 - reported to the learner
        report["error"] = f"connect: {type(e).__name__}: {e}"
        say("ready")
        say("result " + json.dumps(report))
        return 0
    report["rss_ready_mib"] = c.rss_mib()
    say("ready")
    line = sys.stdin.readline().split()
    if line[:1] != ["go"]:
        client.close(timeout=1.0)
        return 1
    start, end = float(line[1]), float(line[2])
    time.sleep(max(0.0, start - time.monotonic()))
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    seq, peak = 0, 0
    try:
        for _ in range(10**9):
            now = time.monotonic()
            if now >= end:
                break
            tree = pool[seq % POOL]
            tree["meta"][:] = (wid, seq, 0)
            client.send(tree, timeout=SEND_TIMEOUT_S)
            seq += 1
            if seq % POLL_EVERY == 0:
                peak = max(peak, client.retained_bytes)
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        report["durable_waits"] = client.durable_waits
        report["durable_wait_s"] = client.durable_wait_s
        report["retained_at_end"] = client.retained_bytes
        t0 = time.monotonic()
        report["flushed"] = client.close(timeout=CLOSE_TIMEOUT_S)
        report["close_s"] = time.monotonic() - t0
        report["given_up"] = client.given_up
        report["persisted"] = client.persisted
    except Exception as e:  # noqa: BLE001 - reported to the learner
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        report["error"] = f"{type(e).__name__}: {e}"
        client.close(timeout=1.0)
    report["sent"] = seq
    report["peak_retained"] = peak
    report["cpu_s"] = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    # The peak of this process's own memory: VmHWM, not getrusage's ru_maxrss, which a process
    # started by subprocess inherits from its parent (Linux keeps the larger of the parent's
    # peak at the fork and exec and the child's: the learner's, here).
    report["peak_rss_mib"] = c.status_kib("VmHWM").get("VmHWM", 0) / 1024.0
    report["ru_maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    say("result " + json.dumps(report))
    return 0


# --------------------------------------------------------------------------- learner


#: How a worker process is started.
MODULE = [sys.executable, "-m", "benches.suites.durable"]


def workers_of(port: int, name: str, k: int, budget: int | None) -> c.LineWorkers:
    """K worker processes of example `name` sending to `port` (durable with `budget`)."""
    cmds = [[*MODULE, "--worker", str(port), name, str(wid), str(budget or 0)] for wid in range(k)]
    return c.LineWorkers(cmds, ROOT)


class Reader:
    """Reads every batch the server hands out: keeps each sample's (worker, seq), checks the
    pool index in every float32 leaf, counts the samples of the window."""

    def __init__(self, server: Server, tree: Any) -> None:
        self.server = server
        self.paths = f32_paths(tree)
        self.ids: list[np.ndarray] = []  # (worker, seq) rows, markers left out
        self.torn = 0
        self.received = 0
        self.markers = 0
        self.in_window = 0

    def read_one(self, timeout: float, window: tuple[float, float]) -> bool:
        """One batch (False on timeout)."""
        try:
            got = self.server.sample(timeout=timeout)
        except TimeoutError:
            return False
        if got is None:
            return False
        now = time.monotonic()
        batch = got.batch
        meta = np.array(batch["meta"])
        real = meta[:, 0] != MARKER
        ids = meta[real, :2].astype(np.int64)
        want = ids[:, 1] % POOL
        for path in self.paths:
            heads = np.asarray(leaf(batch, path)).reshape(len(meta), -1)[real, 0]
            self.torn += int(np.count_nonzero(heads != want))
        self.ids.append(ids)
        n = len(ids)
        self.markers += len(meta) - n
        self.received += n
        if window[0] <= now <= window[1]:
            self.in_window += n
        return True

    def check(self, sent: dict[int, int]) -> list[str]:
        """Every worker's ids ``0 .. sent - 1`` exactly once, and nothing torn."""
        errors = [f"{self.torn} torn leaves"] if self.torn else []
        ids = np.concatenate(self.ids) if self.ids else np.zeros((0, 2), np.int64)
        for wid, n in sent.items():
            seqs = np.sort(ids[ids[:, 0] == wid, 1])
            if len(seqs) != n or not np.array_equal(seqs, np.arange(n)):
                dup = len(seqs) - len(np.unique(seqs))
                errors.append(f"worker {wid}: {len(seqs)} samples of {n} sent ({dup} duplicates)")
        strays = set(np.unique(ids[:, 0]).tolist()) - set(sent)
        if strays:
            errors.append(f"samples of unknown workers {sorted(strays)}")
        return errors


def marker_of(tree: Any) -> Any:
    out = {k: (marker_of(v) if isinstance(v, dict) else v) for k, v in tree.items()}
    if "meta" in out:
        out["meta"] = np.array([MARKER, 0, 0], np.float64)
    return out


def run_round(name: str, k: int, mode: str, interval: float, args: dict[str, Any]) -> dict:
    """One learner, K workers, one mode: the round's numbers and checks."""
    seconds, warmup = float(args["seconds"]), float(args["warmup"])
    tree = example(name)
    budget = budget_of(mode)
    with tempfile.TemporaryDirectory(prefix="echo-durable-") as ckpt:
        server = Server(
            tree,
            EXAMPLES[name],
            transport=TcpTransport(port=0, host=HOST),
            checkpoint_dir=ckpt,
            checkpoint_every=interval,
            checkpoint_keep=2,
        )
        server.start()
        guard = c.call_later(seconds + warmup + 240.0, server.close)
        assert server.port is not None
        workers = workers_of(server.port, name, k, budget)
        reader = Reader(server, tree)
        errors: list[str] = []
        results: list[dict[str, Any]] = []
        try:
            workers.expect("ready", READY_TIMEOUT_S)
            start = time.monotonic() + START_AHEAD_S
            window = (start + warmup, start + warmup + seconds)
            workers.tell(f"go {start!r} {window[1]!r}")
            deadline = window[1] + 120.0
            for _ in range(10**9):
                now = time.monotonic()
                if now > deadline:
                    errors.append("round overran")
                    break
                reader.read_one(0.05, window)
                if now >= window[1]:
                    try:
                        lines = workers.expect("result", 0)
                    except TimeoutError:
                        continue
                    results = [json.loads(x.split(" ", 1)[1]) for x in lines]
                    break
            sent = {r["wid"]: int(r["sent"]) for r in results}
            total = sum(sent.values())
            # Complete the last batch with markers (from a thread: the ring may be full until
            # this one reads), then read until everything sent has arrived.
            pad = (-total) % server.batch_size
            marker = marker_of(tree)
            padder = threading.Thread(
                target=lambda: [server.submit(marker, timeout=30.0) for _ in range(pad)],
                daemon=True,
            )
            padder.start()
            stalled_since = time.monotonic()
            for _ in range(10**9):
                if reader.received >= total and reader.markers >= pad:
                    break
                if reader.read_one(0.2, (0.0, -1.0)):
                    stalled_since = time.monotonic()
                elif time.monotonic() - stalled_since > STALL_S:
                    errors.append(f"stalled: {reader.received} of {total} samples arrived")
                    break
            padder.join(timeout=STALL_S)
            errors += reader.check(sent)
            tally = getattr(server, "_tally", None)  # the periodic checkpoints' outcomes
            checkpoints = getattr(tally, "checkpoints", None)
            failures = getattr(tally, "checkpoint_failures", None)
        finally:
            guard.cancel()
            workers.stop()
            server.close()
    worker_errors = [r["error"] for r in results if r.get("error")]
    if len(results) != k:
        errors.append(f"{len(results)} of {k} workers reported")
    if failures:
        errors.append(f"{failures} checkpoints failed")
    flushed = all(r.get("flushed") and r.get("given_up") == 0 for r in results)
    out = {
        "example": name,
        "mode": mode,
        "interval": interval,
        "samples_per_s": c.rate(reader.in_window, seconds),
        "in_window": reader.in_window,
        "sent": sum(sent.values()),
        "worker_cpu_us_per_sample": 1e6
        * sum(r.get("cpu_s", 0.0) for r in results)
        / max(sum(sent.values()), 1),
        "peak_rss_mib": max((r.get("peak_rss_mib", 0.0) for r in results), default=None),
        "ready_rss_mib": max((r.get("rss_ready_mib", 0.0) for r in results), default=None),
        "peak_retained": max((r.get("peak_retained", 0) for r in results), default=None),
        "durable_waits": sum(r.get("durable_waits", 0) for r in results),
        "durable_wait_s_per_worker": sum(r.get("durable_wait_s", 0.0) for r in results)
        / max(len(results), 1),
        "close_s": max((r.get("close_s", 0.0) for r in results), default=None),
        "checkpoints": checkpoints,
        "worker_errors": worker_errors,
        "errors": errors,
        "correct": not errors and not worker_errors and flushed,
    }
    log(
        f"{name} {mode} every {interval:g} s: {out['samples_per_s']:,.0f} samples/s, "
        f"peak RSS {out['peak_rss_mib']:.1f} MiB, retained {out['peak_retained'] / c.MIB:.1f} MiB, "
        f"{out['durable_waits']} waits {out['durable_wait_s_per_worker']:.2f} s/worker, "
        f"close {out['close_s']:.2f} s, "
        f"{checkpoints} checkpoints, correct={out['correct']} {errors[:2]}{worker_errors[:1]}"
    )
    return out


def parameters(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "examples": list(EXAMPLES),
            "workers": 2,
            "intervals": [1.0],
            "budgets_mib": [64, 1],
            "repeats": 1,
            "seconds": 3.0,
            "warmup": 1.0,
        }
    return {
        "examples": list(EXAMPLES),
        "workers": 4,
        "intervals": [1.0],
        "budgets_mib": [64, 1],
        "repeats": 3,
        "seconds": 8.0,
        "warmup": 1.0,
    }


def limit_s(params: dict[str, Any]) -> float:
    rounds = (
        len(params["examples"])
        * len(params["intervals"])
        * (1 + len(params["budgets_mib"]))
        * int(params["repeats"])
    )
    return rounds * (float(params["seconds"]) + float(params["warmup"]) + 60.0) + 60.0


def measure(params: dict[str, Any]) -> dict[str, Any]:
    k, repeats = int(params["workers"]), int(params["repeats"])
    modes = mode_names([float(b) for b in params["budgets_mib"]])
    rounds: list[dict[str, Any]] = []
    for rep in range(repeats):
        order = modes if rep % 2 == 0 else modes[::-1]
        for name in params["examples"]:
            for interval in params["intervals"]:
                for mode in order:
                    r = run_round(name, k, mode, float(interval), params)
                    rounds.append({"repeat": rep, **r})
    summary = []
    for name in params["examples"]:
        tree = example(name)
        for interval in params["intervals"]:
            cell = [r for r in rounds if r["example"] == name and r["interval"] == interval]
            plain = {r["repeat"]: r["samples_per_s"] for r in cell if r["mode"] == "plain"}
            for mode in modes:
                rows = [r for r in cell if r["mode"] == mode]
                ratios = [
                    r["samples_per_s"] / plain[r["repeat"]] for r in rows if plain.get(r["repeat"])
                ]

                def med(key: str, rows: list[dict[str, Any]] = rows) -> float | None:
                    vals = [float(r[key]) for r in rows if r.get(key) is not None]
                    return statistics.median(vals) if vals else None

                summary.append(
                    {
                        "example": name,
                        "bytes": sample_bytes(tree),
                        "leaves": count_leaves(tree),
                        "interval": interval,
                        "mode": mode,
                        "durable_bytes": budget_of(mode),
                        "samples_per_s": med("samples_per_s"),
                        "ratio_to_plain": statistics.median(ratios) if ratios else None,
                        "ratios": ratios,
                        "peak_rss_mib": med("peak_rss_mib"),
                        "ready_rss_mib": med("ready_rss_mib"),
                        "peak_retained": med("peak_retained"),
                        "durable_waits": med("durable_waits"),
                        "durable_wait_s_per_worker": med("durable_wait_s_per_worker"),
                        "worker_cpu_us_per_sample": med("worker_cpu_us_per_sample"),
                        "close_s": med("close_s"),
                        "correct": bool(rows) and all(r["correct"] for r in rows),
                    }
                )
    return {
        "k": k,
        "summary": summary,
        "rounds": rounds,
        "correct": all(s["correct"] for s in summary),
    }


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    columns = [
        "echo",
        "example",
        "bytes",
        "leaves",
        "mode",
        "samples/s",
        "/ plain",
        "range",
        "worker peak RSS MiB (connected)",
        "peak retained MiB",
        "blocked sends",
        "s blocked per worker",
        "worker us/sample",
        "correct",
    ]
    rows = c.failed_rows(results, len(columns))
    for side, r in results.items():
        for s in r.get("summary", []):
            retained = s["peak_retained"]
            rows.append(
                [
                    side,
                    f"{s['example']}, every {s['interval']:g} s",
                    f"{s['bytes']:,}",
                    str(s["leaves"]),
                    s["mode"],
                    c.num(s["samples_per_s"]),
                    c.num(s["ratio_to_plain"], ".2f"),
                    c.span(s["ratios"]),
                    f"{c.num(s['peak_rss_mib'], '.1f')} ({c.num(s['ready_rss_mib'], '.1f')})",
                    c.num(None if retained is None else retained / c.MIB, ".2f"),
                    c.num(s["durable_waits"]),
                    c.num(s["durable_wait_s_per_worker"], ".2f"),
                    c.num(s["worker_cpu_us_per_sample"], ".1f"),
                    "yes" if s["correct"] else "NO",
                ]
            )
    k = next((r["k"] for r in results.values() if "k" in r), params["workers"])
    sending = float(params["warmup"]) + float(params["seconds"])
    return [
        {
            "title": f"Durable against plain acknowledgements: {k} worker processes, "
            f"checkpoints every {', '.join(f'{i:g}' for i in params['intervals'])} s, "
            f"{params['repeats']} repeat(s) of {params['seconds']:g} s (medians)",
            "columns": columns,
            "rows": rows,
            "notes": [
                "*example*: the samples and the learner's `checkpoint_every`. *mode*: `plain` "
                "is `TcpClient(reconnect=True, shared_memory=False)`, `durable N MiB` is "
                "`TcpClient(durable=True, durable_bytes=N MiB, shared_memory=False)`: both over "
                "TCP. *range*: the per-repeat ratios "
                "to plain. *worker peak RSS*: the largest worker's peak (`VmHWM`; `getrusage`'s "
                "`ru_maxrss` would hold the learner's, which started it), in brackets its RSS "
                "once connected. *peak retained*: the largest `retained_bytes` a worker saw "
                "(read every 8 sends). *blocked sends*: `durable_waits` of all workers; *s "
                "blocked per worker*: their `durable_wait_s`, over the warmup and the window "
                f"({sending:g} s of sending, plus the last blocked send). *worker us/sample*: "
                "the workers' CPU per sample sent.",
                "A durable worker keeps one copy of each sample until a checkpoint holds it: "
                "what a checkpoint interval accumulates, about (its rate) x (interval + one "
                "checkpoint's time) x (bytes per sample), capped by `durable_bytes`. Under the "
                "cap that memory is the whole cost; a worker that reaches the cap blocks in "
                "`send()` until the next checkpoint, and its rate falls to about "
                "`durable_bytes` per checkpoint interval.",
            ],
        }
    ]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2:]))
