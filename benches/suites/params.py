"""Parameters down: what fetching, serving and publishing a 10 MB policy costs on one host.

The parameters are a nested pytree of 8 ``float32`` leaves of different sizes (``bytes``, 10
MB by default: a dense torso, an LSTM, policy and value heads, each ``(rows, 128)``). This
process (the suite's child) is the learner, ``Server(sample, batch_size,
transport=TcpTransport(port=0, host="127.0.0.1"))``; the workers are processes of this
interpreter running :mod:`benches.suites.params_workers` (which also makes the pytrees), so
a fetch crosses processes as in a run; :mod:`benches.suites.params_tables` renders the
tables. The parts:

* **fetch**: one worker process with ``TcpClient(..., params_example=tree,
  shared_memory=False)`` and one with ``shared_memory=True`` time ``fetches`` calls of
  ``client.params()`` each (every copy's sha256 checked against the published version's,
  outside the timing), against two references measured in the same run: a numpy memcpy of
  the same bytes (``np.copyto`` into a preallocated buffer, in the learner's process) and a
  plain loopback TCP blast (a Python sender thread in the learner's process ``sendall``-ing
  the bytes for each one-byte request, a third worker process ``recv_into``-ing them into a
  preallocated buffer). ``repeats`` rounds, the four in alternating order; GB/s of the best
  and of the median copy, the ratios best to best. Over TCP a fetch pulls 1 MiB chunks
  through the socket; on a shared-memory connection (the learner's host) echo copies the
  version out of the learner's shared-memory slots (an echo older than that fetches over
  the connection's socket there too).
* **ray**: ``ray.get`` of the same pytree from Ray's object store in an actor (another
  process) on a local Ray instance (``num_cpus=2``), with a ``ray.put`` of a fresh object
  for each get (timed: the learner's side of Ray's way); once as Ray hands it out (zero-copy
  read-only views into the object store) and once copied into arrays of the actor's own, as
  ``params()`` returns them. Skipped, and said so, where ray is not importable (or with
  ``--set ray=false``).
* **publish**: ``publishes`` calls of ``server.publish(tree)`` with nothing fetching (the
  fetch workers connected), each a new version.
* **latency**: the learner's ``sample()`` latency with and without parameters moving. A
  FIFO server (``batch_size``, ``num_buffers`` 8) fed by ``feeders`` worker processes
  sending small nested samples (7 leaves, 141 bytes, over TCP) as fast as the ring takes
  them; the learner calls ``sample()`` every ``step_ms`` (a training step's pace: the
  feeders keep the ring ahead of it, so ``sample()`` measures the learner's side, not the
  feed) and reads each batch. Phases of ``seconds`` each: ``quiet`` (nothing published, no
  fetch), then one per fetch mode with the learner publishing a new version every ``1 /
  publish_hz`` s between its steps (in the learner's loop, as a learner does; the publish
  is not in the ``sample()`` numbers, its own latency is reported) while K fetcher
  processes fetch, for each K of ``fetchers`` (2 and 8): ``newest`` (each waits for the
  next version and fetches it, as a worker that follows the learner) or ``back-to-back``
  (each fetches again as soon as it has a copy: the most load K workers can make). The
  fetchers start once and stay connected, idle when a phase does not use them. Every
  fetched copy's stamps (its version in every 16,384th element of each leaf) are checked,
  and each worker's versions must never go back. The phases run ``repeats`` times in
  alternating order; the p99 rise is per repeat, against that repeat's quiet phase.
  ``correct`` also needs every sample the learner read intact, in per-feeder order and
  without a gap.

Every loop is bounded in count and time: the workers stop at their deadlines and have
watchdogs, the learner closes its server when a phase overruns, and the driver ends (by
PID) only the processes it started. Loopback only.

Run: ``python -m benches params [--quick] [--set fetchers=[4,16]] [--set bytes=40000000]``.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benches import common as c
from benches.suites.params_tables import tables as tables
from benches.suites.params_workers import (
    CALL_S,
    HOST,
    MAX_LOOPS,
    digest,
    leaves,
    nbytes,
    pytree,
    sample_bytes,
    sample_example,
    shapes,
    stamp,
)
from echo import Server, TcpTransport

ROOT = Path(__file__).resolve().parent.parent.parent
MODES = ("newest", "back-to-back")
READY_TIMEOUT_S = 90.0  # interpreter start-up of a dozen workers on a busy 2-core machine
START_AHEAD_S = 0.5
NUM_BUFFERS = 8
#: How a worker process is started.
MODULE = [sys.executable, "-m", "benches.suites.params_workers"]

log = c.logger("params")


def fetchers(port: int, size: int, k: int, shm: bool) -> c.LineWorkers:
    cmd = [*MODULE, "--worker", str(port), str(size), "1" if shm else "0"]
    return c.LineWorkers([list(cmd) for _ in range(k)], ROOT)


def ask(workers: c.LineWorkers, line: str, timeout: float) -> list[dict[str, Any]]:
    """Tells every worker ``line`` and returns their ``result`` answers."""
    workers.tell(line)
    return [json.loads(x.split(" ", 1)[1]) for x in workers.expect("result", timeout)]


# --------------------------------------------------------------------------- fetch


class BlastServer:
    """The loopback reference's sender: a thread that accepts one connection and answers
    each byte it reads with ``payload`` (``sendall``)."""

    def __init__(self, size: int) -> None:
        self.payload = b"\x07" * size
        self.used = False
        self.listener = socket.create_server((HOST, 0))
        self.listener.settimeout(READY_TIMEOUT_S)
        self.port = int(self.listener.getsockname()[1])
        self.error: str | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
            self.used = True
            with conn:
                conn.settimeout(CALL_S)
                for _ in range(MAX_LOOPS):
                    if not conn.recv(1):
                        return
                    conn.sendall(self.payload)
        except OSError as e:
            self.error = f"{type(e).__name__}: {e}"

    def close(self) -> None:
        self.listener.close()
        self.thread.join(timeout=10.0)


def memcpy_seconds(size: int, n: int) -> list[float]:
    """``n`` timed ``np.copyto`` of ``size`` bytes into a preallocated buffer."""
    src = np.full(size, 7, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in before timing
    times: list[float] = []
    for _ in range(n):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return times


def summary(times: list[float], size: int, bad: int = 0) -> dict[str, Any]:
    """GB/s of the best and of the median copy (1e9 B/s), ms of the median."""
    if not times:
        return {"n": 0, "bad": bad}
    best, med = min(times), statistics.median(times)
    return {
        "n": len(times),
        "gbps_best": size / best / 1e9,
        "gbps_median": size / med / 1e9,
        "ms_median": 1e3 * med,
        "ms_p99": 1e3 * c.percentile(times, 99),
        "bad": bad,
    }


def measure_fetch(
    server: Server, tree: dict[str, Any], params: dict[str, Any]
) -> tuple[dict[str, Any], list[c.LineWorkers]]:
    """The fetch part: memcpy, the loopback blast and ``params()`` over TCP and on a shared
    memory connection (the worker processes stay connected, for the publish part)."""
    size, n, repeats = nbytes(tree), int(params["fetches"]), int(params["repeats"])
    assert server.port is not None
    version = server.publish(tree)
    expected = digest(tree)
    tcp = fetchers(server.port, int(params["bytes"]), 1, shm=False)
    shm = fetchers(server.port, int(params["bytes"]), 1, shm=True)
    blast = fetchers(server.port, int(params["bytes"]), 1, shm=False)  # its own sockets
    sender = BlastServer(size)
    times: dict[str, list[float]] = {k: [] for k in ("memcpy", "blast", "tcp", "shm")}
    bad = dict.fromkeys(times, 0)
    errors: list[str] = []
    order = list(times)
    paths = {}
    try:
        for name, w in (("tcp", tcp), ("shm", shm), ("blast", blast)):
            paths[name] = w.expect("ready", READY_TIMEOUT_S)[0].split()[1]
        for rep in range(repeats):
            for name in order if rep % 2 == 0 else order[::-1]:
                if name == "memcpy":
                    times[name] += memcpy_seconds(size, n)
                    continue
                if name == "blast":
                    if sender.used:  # it accepts one connection: a fresh one per repeat
                        sender.close()
                        sender = BlastServer(size)
                    (r,) = ask(blast, f"blast {sender.port} {n}", CALL_S * n)
                else:
                    worker = tcp if name == "tcp" else shm
                    (r,) = ask(worker, f"time {n} {version} {expected}", CALL_S * n)
                if r["error"]:
                    errors.append(f"{name}: {r['error']}")
                    continue
                times[name] += r["seconds"]
                bad[name] += int(r["bad"])
    except BaseException:
        tcp.stop()
        shm.stop()
        raise
    finally:
        sender.close()
        blast.stop()
    if sender.error:
        errors.append(f"blast sender: {sender.error}")
    out: dict[str, Any] = {name: summary(t, size, bad[name]) for name, t in times.items()}
    out["paths"] = paths
    out["errors"] = errors
    out["correct"] = not errors and not any(bad.values()) and paths["shm"] == "shm"
    log(
        "fetch GB/s (best): "
        + ", ".join(f"{k} {out[k].get('gbps_best', float('nan')):.2f}" for k in times)
        + f", paths {paths}, errors {errors}"
    )
    return out, [tcp, shm]


# --------------------------------------------------------------------------- ray


class RayFetcher:
    """The Ray actor of the ray part: gets a pytree from the object store."""

    def ready(self) -> int:
        return os.getpid()

    def fetch(self, refs: list[Any], expected: str) -> dict[str, Any]:
        import ray

        t = time.perf_counter()
        tree: dict[str, Any] = ray.get(refs[0], timeout=CALL_S)
        got = time.perf_counter()
        own = {g: {k: np.array(v) for k, v in sub.items()} for g, sub in tree.items()}
        copied = time.perf_counter()
        return {
            "get_s": got - t,
            "get_copy_s": copied - t,
            "zero_copy": not leaves(tree)[0].flags.writeable,
            "ok": digest(own) == expected,
        }


def measure_ray(tree: dict[str, Any], n: int, enabled: bool) -> dict[str, Any]:
    """``ray.get`` of ``tree`` in an actor, each of ``n`` times a fresh ``ray.put`` (after
    one untimed round); ``{"status": ...}`` alone where it did not run."""
    if not enabled:
        return {"status": "not measured (ray=false)"}
    try:
        import ray
    except ImportError as e:
        return {"status": f"not installed ({e})"}
    size = nbytes(tree)
    t0 = time.monotonic()
    # A Ray of its own (`address="local"`): without it, `ray.init` joins a cluster another
    # process on this machine started (a test running beside this one) and refuses num_cpus.
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=max(256 * c.MIB, 8 * size),
        log_to_driver=False,
        namespace="echo-bench-params",
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    try:
        start_s = time.monotonic() - t0
        actor = ray.remote(RayFetcher).options(num_cpus=0).remote()
        ray.get(actor.ready.remote(), timeout=180.0)
        expected = digest(tree)
        puts: list[float] = []
        rounds: list[dict[str, Any]] = []
        for i in range(n + 1):
            t = time.perf_counter()
            ref = ray.put(tree)
            put_s = time.perf_counter() - t
            r: dict[str, Any] = ray.get(actor.fetch.remote([ref], expected), timeout=CALL_S)
            del ref
            if i > 0:
                puts.append(put_s)
                rounds.append(r)
        ok = all(r["ok"] for r in rounds)
        out: dict[str, Any] = {
            "status": "measured",
            "ray_version": ray.__version__,
            "start_s": start_s,
            "get": summary([r["get_s"] for r in rounds], size),
            "get_copy": summary([r["get_copy_s"] for r in rounds], size, 0 if ok else 1),
            "put": summary(puts, size),
            "put_ms": [1e3 * p for p in puts],
            "zero_copy": all(r["zero_copy"] for r in rounds),
            "correct": ok,
        }
    finally:
        ray.shutdown()
    log(
        f"ray {out['ray_version']}: get {out['get']['gbps_best']:.2f} GB/s (zero-copy "
        f"{out['zero_copy']}), get+copy {out['get_copy']['gbps_best']:.2f} GB/s, put "
        f"{out['put']['ms_median']:.2f} ms"
    )
    return out


# --------------------------------------------------------------------------- latency


class Reader:
    """Reads every batch: keeps each sample's (feeder, seq), checks its ``obs`` leaves."""

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.torn = 0
        self.received = 0

    def take(self, batch: Any) -> None:
        meta = np.array(batch["meta"])
        want = meta[:, 1] % 1000
        for key in ("a", "b"):
            heads = np.asarray(batch["obs"][key])
            self.torn += int(np.count_nonzero(heads != want[:, None]))
        self.ids.append(meta.astype(np.int64))
        self.received += len(meta)

    def check(self, sent: dict[int, int]) -> list[str]:
        """Every feeder's samples arrived in order, none twice, none skipped (a prefix of
        what it sent: the ring keeps what the learner has not read)."""
        errors = [f"{self.torn} torn sample leaves"] if self.torn else []
        ids = np.concatenate(self.ids) if self.ids else np.zeros((0, 2), np.int64)
        for wid, n in sent.items():
            seqs = ids[ids[:, 0] == wid, 1]
            if len(seqs) > n or not np.array_equal(seqs, np.arange(len(seqs))):
                errors.append(f"feeder {wid}: {len(seqs)} samples of {n}, not 0.. in order")
        strays = set(np.unique(ids[:, 0]).tolist()) - set(sent)
        if strays:
            errors.append(f"samples of unknown feeders {sorted(strays)}")
        return errors


def run_phase(
    server: Server,
    reader: Reader,
    mode: str,
    groups: list[c.LineWorkers],
    tree: dict[str, Any],
    params: dict[str, Any],
) -> dict[str, Any]:
    """One phase: ``sample()`` every ``step_ms`` for ``seconds``; with a fetch mode, the
    learner publishes at ``publish_hz`` between its steps while the fetchers of ``groups``
    fetch."""
    seconds, step = float(params["seconds"]), float(params["step_ms"]) / 1e3
    period = 1.0 / float(params["publish_hz"])
    loaded = mode != "quiet"
    start = time.monotonic() + (START_AHEAD_S if loaded else 0.0)
    end = start + seconds
    if loaded:
        for group in groups:
            group.tell(f"loop {mode} {end!r}")
    time.sleep(max(0.0, start - time.monotonic()))
    lat: list[float] = []
    publish_s: list[float] = []
    errors: list[str] = []
    next_step = next_publish = time.monotonic()
    samples0 = reader.received
    for _ in range(MAX_LOOPS):
        now = time.monotonic()
        if now >= end:
            break
        t = time.perf_counter()
        try:
            got = server.sample(timeout=CALL_S)
        except TimeoutError:
            errors.append(f"{mode}: sample() timed out")
            break
        lat.append(time.perf_counter() - t)
        if got is None:
            errors.append(f"{mode}: the server closed")
            break
        reader.take(got.batch)
        if loaded and now >= next_publish:
            stamp(tree, server.params_version + 1)
            t = time.perf_counter()
            server.publish(tree)
            publish_s.append(time.perf_counter() - t)
            next_publish += period
            if next_publish < now:  # fell behind (a slow publish): no burst to catch up
                next_publish = now + period
        next_step += step
        pause = next_step - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        elif pause < -step:  # fell behind: no burst of steps to catch up
            next_step = time.monotonic()
    elapsed = min(time.monotonic(), end) - start
    fetch: list[dict[str, Any]] = []
    for group in groups if loaded else []:
        fetch += [json.loads(x.split(" ", 1)[1]) for x in group.expect("result", CALL_S)]
        errors += [f"fetcher {i}: {r['error']}" for i, r in enumerate(fetch) if r["error"]]
    torn = sum(int(r.get("torn_leaves", 0)) for r in fetch)
    backwards = sum(int(r.get("backwards", 0)) for r in fetch)
    if torn:
        errors.append(f"{mode}: {torn} torn leaves in fetched copies")
    if backwards:
        errors.append(f"{mode}: a fetcher's version went back {backwards} times")
    if loaded and any(not r.get("fetches") for r in fetch):
        errors.append(f"{mode}: a fetcher fetched nothing")
    fetches = sum(int(r.get("fetches", 0)) for r in fetch)
    size = nbytes(tree)
    out = {
        "mode": mode,
        "fetchers": len(fetch),
        "samples": len(lat),
        "sample_p50_ms": 1e3 * c.percentile(lat, 50),
        "sample_p99_ms": 1e3 * c.percentile(lat, 99),
        "sample_max_ms": 1e3 * max(lat, default=float("nan")),
        "samples_per_s": c.rate(reader.received - samples0, elapsed),
        "publishes": len(publish_s),
        "publish_hz": c.rate(len(publish_s), elapsed),
        "publish_p50_ms": 1e3 * c.percentile(publish_s, 50) if publish_s else None,
        "publish_p99_ms": 1e3 * c.percentile(publish_s, 99) if publish_s else None,
        "publish_max_ms": 1e3 * max(publish_s) if publish_s else None,
        "fetches": fetches,
        "fetched_gbps": c.rate(fetches * size / 1e9, elapsed),
        "fetch_p50_ms": c.median([r["fetch_p50_ms"] for r in fetch if r.get("fetch_p50_ms")]),
        "versions_per_fetcher": c.median([r["distinct_versions"] for r in fetch]),
        "errors": errors,
    }
    log(
        f"{mode}: sample p50 {out['sample_p50_ms']:.3f} p99 {out['sample_p99_ms']:.3f} max "
        f"{out['sample_max_ms']:.2f} ms, {out['samples_per_s']:,.0f} samples/s, "
        f"{len(publish_s)} publishes, {fetches} fetches ({out['fetched_gbps']:.2f} GB/s) "
        f"{errors[:2]}"
    )
    return out


def measure_latency(tree: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The latency part: quiet and loaded phases against one FIFO server and its feeders.
    The fetcher processes start once, in groups (``fetchers`` [2, 8]: one of 2 and one of 6),
    so that a phase with K fetchers has the first groups fetch and the others stay idle."""
    k_feed, repeats = int(params["feeders"]), int(params["repeats"])
    counts = sorted({int(k) for k in params["fetchers"]})
    kinds = [("quiet", 0)] + [(m, k) for k in counts for m in params["fetch_modes"]]
    seconds = float(params["seconds"])
    server = Server(
        sample_example(),
        int(params["batch_size"]),
        num_buffers=NUM_BUFFERS,
        transport=TcpTransport(port=0, host=HOST),
    )
    server.start()
    total_s = (repeats * len(kinds) + 1) * (seconds + START_AHEAD_S + 5.0) + 60.0
    guard = c.call_later(total_s + 2 * READY_TIMEOUT_S, server.close)
    assert server.port is not None
    tree = {g: {k: np.array(v) for k, v in sub.items()} for g, sub in tree.items()}
    stamp(tree, 1)
    server.publish(tree)
    feed = c.LineWorkers(
        [[*MODULE, "--feeder", str(server.port), str(w)] for w in range(k_feed)], ROOT
    )
    sizes = [k - prev for prev, k in zip([0, *counts[:-1]], counts, strict=True)]
    groups = [fetchers(server.port, int(params["bytes"]), n, shm=False) for n in sizes]
    reader = Reader()
    phases: list[dict[str, Any]] = []
    errors: list[str] = []
    sent: dict[int, int] = {}
    try:
        feed.expect("ready", READY_TIMEOUT_S)
        for group in groups:
            group.expect("ready", READY_TIMEOUT_S)
        start = time.monotonic() + START_AHEAD_S
        feed.tell(f"go {start!r} {start + total_s!r}")
        time.sleep(max(0.0, start - time.monotonic()))
        run_phase(server, reader, "quiet", [], tree, dict(params, seconds=1.0))  # warm-up
        for rep in range(repeats):
            for mode, k in kinds if rep % 2 == 0 else kinds[::-1]:
                using = groups[: counts.index(k) + 1] if k else []
                r = run_phase(server, reader, mode, using, tree, params)
                phases.append({"repeat": rep, "k": k, **r})
                errors += r["errors"]
        # Stop the feeders (their deadline was a bound), keep reading until they flushed.
        feed.tell("stop")
        results: list[dict[str, Any]] = []
        deadline = time.monotonic() + total_s
        for _ in range(MAX_LOOPS):
            if time.monotonic() > deadline:
                errors.append("the feeders never reported")
                break
            try:
                got = server.sample(timeout=0.05)
            except TimeoutError:
                got = None
            if got is not None:
                reader.take(got.batch)
            try:
                lines = feed.expect("result", 0)
            except TimeoutError:
                continue
            results = [json.loads(x.split(" ", 1)[1]) for x in lines]
            break
        sent = {int(r["wid"]): int(r["sent"]) for r in results}
        errors += [f"feeder {r['wid']}: {r['error']}" for r in results if r["error"]]
        errors += reader.check(sent)
    finally:
        guard.cancel()
        feed.stop()
        for group in groups:
            group.stop()
        server.close()
    quiet = {p["repeat"]: p["sample_p99_ms"] for p in phases if p["mode"] == "quiet"}
    for p in phases:
        base = quiet.get(p["repeat"])
        p["p99_rise_ms"] = None if base is None else p["sample_p99_ms"] - base
    return {
        "feeders": k_feed,
        "fetchers": counts,
        "sample_bytes": sample_bytes(),
        "phases": phases,
        "sent": sum(sent.values()),
        "received": reader.received,
        "errors": errors,
        "correct": not errors,
    }


# --------------------------------------------------------------------------- the suite


def parameters(quick: bool) -> dict[str, Any]:
    return {
        "bytes": 10_000_000,
        "fetches": 10 if quick else 20,
        "repeats": 1 if quick else 3,
        "ray": True,
        "ray_fetches": 10 if quick else 20,
        "publishes": 10 if quick else 30,
        "feeders": 4,
        "fetchers": [2, 8],
        "fetch_modes": list(MODES),
        "publish_hz": 10.0,
        "step_ms": 2.0,
        "batch_size": 32,
        "seconds": 2.0 if quick else 5.0,
    }


def limit_s(params: dict[str, Any]) -> float:
    kinds = 1 + len(params["fetchers"]) * len(params["fetch_modes"])
    phases = int(params["repeats"]) * kinds + 1
    latency = phases * (float(params["seconds"]) + 10.0) + 2 * READY_TIMEOUT_S
    fetch = 3 * READY_TIMEOUT_S + int(params["repeats"]) * int(params["fetches"]) * 4 * 2.0
    ray = 300.0 if params["ray"] else 0.0
    return latency + fetch + ray + 120.0


def measure(params: dict[str, Any]) -> dict[str, Any]:
    size_arg = int(params["bytes"])
    tree = pytree(size_arg, seed=1)
    size = nbytes(tree)
    server = Server(
        sample_example(), int(params["batch_size"]), transport=TcpTransport(port=0, host=HOST)
    )
    server.start()
    guard = c.call_later(limit_s(params), server.close)
    connected: list[c.LineWorkers] = []
    try:
        fetch, connected = measure_fetch(server, tree, params)
        # Publish latency: a new version each time, nothing fetching (two workers connected).
        publish_s: list[float] = []
        for _ in range(int(params["publishes"])):
            stamp(tree, server.params_version + 1)
            t = time.perf_counter()
            server.publish(tree)
            publish_s.append(time.perf_counter() - t)
        publish = summary(publish_s, size)
        publish["ms"] = [1e3 * s for s in publish_s]
        log(f"publish: p50 {publish['ms_median']:.2f} ms, p99 {publish['ms_p99']:.2f} ms")
    finally:
        guard.cancel()
        for w in connected:
            w.stop()
        server.close()
    ray = measure_ray(pytree(size_arg, seed=1), int(params["ray_fetches"]), bool(params["ray"]))
    latency = measure_latency(pytree(size_arg, seed=2), params)
    return {
        "bytes": size,
        "leaves": [list(s) for s in shapes(size_arg)],
        "fetch": fetch,
        "publish": publish,
        "ray": ray,
        "latency": latency,
        "correct": bool(fetch["correct"] and latency["correct"] and ray.get("correct", True)),
    }
