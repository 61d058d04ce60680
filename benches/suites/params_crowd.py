"""A crowd fetching parameters: do many workers fetching the learner's parameters at once
starve the sample ingress?

This process (the suite's child) is the learner, ``Server(sample, batch_size,
transport=TcpTransport(port=0, host="127.0.0.1"))``, with a consumer thread that calls
``server.sample()`` back to back and reads every batch (each sample's feeder and sequence
number checked, every leaf summed). ``feeders`` feeder processes of
:mod:`benches.suites.params_workers` (``--feeder``) send small nested samples (7 leaves, 141
bytes, over TCP) as fast as the server takes them, through every phase. The phases, of
``seconds`` each:

* **baseline**: the feeders alone, nothing else connected, nothing published.
* **idle**: ``fetchers`` fetcher connections open (``--crowd`` processes of
  :mod:`benches.suites.params_workers`, ``processes`` of them, each holding ``fetchers /
  processes`` ``TcpClient(..., params_example=tree, shared_memory=False)`` connections),
  none fetching, nothing published: what the open connections alone cost.
* **crowd**: every fetcher connection fetching a ``bytes`` (1 MB) parameter pytree back to
  back, a thread per connection (``params(min_version=newest it has)``, so a call returns
  the latest version at once), while the learner publishes a new version at ``publish_hz``
  (``stamp(tree, v); server.publish(tree)``). Once for each niceness of ``nice`` (0 and
  19), every thread of the fetcher processes set to it: on a small machine a thousand
  fetching threads (and the kernel's loopback work they cause) take the learner's cores
  at nice 0, so ingress lost there is lost to the machine, not necessarily to the
  server; at nice 19 the learner and its feeders come first, and what the ingress loses is
  the server's own doing (its threads serving the fetches), which is the question here.
  But a thousand runnable threads at nice 19 still outweigh the learner's few at nice 0, so
  a last crowd phase (``cgroup``, when this process may make one, as root) also puts the
  fetcher processes in a cgroup-v1 ``cpu`` group of ``cpu.shares`` 2 (the learner's is
  1024): they run on the CPU the learner leaves, as workers on other hosts would. The group
  is removed, and the processes moved back, after the phase.

Per phase: the ingress's samples/s (``samples_inserted_total`` of ``server.stats()``), the
samples the consumer read and its ``sample()`` latency p50/p99, the connections open
(``active_connections``, polled), and in the crowd phase the fetches completed (in all, per
second, and per connection: min / median / max, the share of connections with at least one,
the longest wait for a connection's first one), the bytes served
(``params_bytes_served_total``) and every fetched copy's stamps (its version in every
16,384th element of each leaf: a torn copy shows). A fetch that completes after the phase is
checked but not counted in it. ``correct`` needs no torn copy, no version going back, no
fetch error, every connection open, and every sample the learner read intact, in per-feeder
order and without a gap.

Every loop is bounded in count and time: the workers stop at their deadlines and have
watchdogs, a guard closes the server when the run overruns, and the learner ends (by PID)
only the processes it started. Loopback only.

Run: ``python -m benches params-crowd [--quick] [--set fetchers=2000] [--set processes=16]``.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np

from benches import common as c
from benches.suites.params import MODULE, READY_TIMEOUT_S, ROOT, START_AHEAD_S, Reader
from benches.suites.params_workers import (
    CALL_S,
    CROWD_GRACE_S,
    HOST,
    MAX_LOOPS,
    nbytes,
    pytree,
    raise_nofile,
    sample_bytes,
    sample_example,
    stamp,
)
from echo import Server, TcpTransport

log = c.logger("params-crowd")
WARMUP_S = 1.0  # the feeders' first second, not measured
POLL_S = 0.1  # how often a phase reads the connection count (and publishes, at most)


def _cpu_s() -> float:
    """CPU seconds (user and system) of this process so far: the learner, every thread."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _touch(tree: Any) -> float:
    """The sum of every leaf of a batch: reads every byte the learner was handed."""
    if isinstance(tree, dict):
        values: list[Any] = list(cast("dict[str, Any]", tree).values())
        return sum(_touch(v) for v in values)
    return float(np.asarray(tree).sum())


class Consumer:
    """The learner's consumer: a thread that calls ``server.sample()`` back to back until
    stopped (or ``max_s``), reads every batch, and notes when each call returned, how long it
    took and how many samples it brought."""

    def __init__(self, server: Server, max_s: float) -> None:
        self.server = server
        self.reader = Reader()
        self.done: list[float] = []  # monotonic time each sample() returned
        self.took: list[float] = []  # its latency (s)
        self.count: list[int] = []  # its samples
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.deadline = time.monotonic() + max_s
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for _ in range(MAX_LOOPS):
            if self.stop.is_set() or time.monotonic() > self.deadline:
                break
            t = time.perf_counter()
            try:
                got = self.server.sample(timeout=1.0)
            except TimeoutError:
                continue
            except Exception as e:  # noqa: BLE001 - reported in the result
                self.errors.append(f"sample(): {type(e).__name__}: {e}")
                break
            took = time.perf_counter() - t
            if got is None:  # the server closed (the guard)
                if not self.stop.is_set():
                    self.errors.append("sample(): the server closed")
                break
            self.reader.take(got.batch)
            _touch(got.batch)
            self.done.append(time.monotonic())
            self.took.append(took)
            self.count.append(len(np.asarray(got.batch["meta"])))

    def window(self, start: float, end: float) -> tuple[list[float], int]:
        """The ``sample()`` latencies (s) of calls that returned in ``[start, end]``, and the
        samples they brought."""
        n = min(len(self.done), len(self.took), len(self.count))
        idx = [i for i in range(n) if start <= self.done[i] <= end]
        return [self.took[i] for i in idx], sum(self.count[i] for i in idx)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10.0)


def run_phase(
    server: Server,
    consumer: Consumer,
    name: str,
    tree: dict[str, Any],
    params: dict[str, Any],
    crowd: c.LineWorkers | None,
    nice: int = 0,
) -> dict[str, Any]:
    """One phase of ``seconds``: the counters before and after, the connections polled; with
    ``crowd``, its processes fetch (at niceness ``nice``) and the learner publishes at
    ``publish_hz``."""
    seconds, period = float(params["seconds"]), 1.0 / float(params["publish_hz"])
    start = time.monotonic() + START_AHEAD_S
    end = start + seconds
    if crowd is not None:
        crowd.tell(f"loop {start!r} {end!r} {nice}")
    time.sleep(max(0.0, start - time.monotonic()))
    st0 = server.stats()
    cpu0 = _cpu_s()
    t0 = time.monotonic()
    conns: list[int] = []
    publish_s: list[float] = []
    next_publish = t0
    for _ in range(MAX_LOOPS):
        now = time.monotonic()
        if now >= end:
            break
        conns.append(int(server.stats().active_connections))
        if crowd is not None and now >= next_publish:
            stamp(tree, server.params_version + 1)
            t = time.perf_counter()
            server.publish(tree)
            publish_s.append(time.perf_counter() - t)
            next_publish += period
            if next_publish < now:  # fell behind: no burst to catch up
                next_publish = now + period
        wake = min(end, now + POLL_S, next_publish if crowd is not None else end)
        time.sleep(max(0.0, wake - time.monotonic()))
    st1 = server.stats()
    elapsed = time.monotonic() - t0
    cpu = _cpu_s() - cpu0
    lat, consumed = consumer.window(t0, t0 + elapsed)
    served = int(st1.params_bytes_served_total) - int(st0.params_bytes_served_total)
    out: dict[str, Any] = {
        "phase": name,
        "nice": nice if crowd is not None else None,
        "seconds": elapsed,
        "ingress_per_s": c.rate(
            int(st1.samples_inserted_total) - int(st0.samples_inserted_total), elapsed
        ),
        "consumed_per_s": c.rate(consumed, elapsed),
        "sample_calls": len(lat),
        "sample_p50_ms": 1e3 * c.percentile(lat, 50),
        "sample_p99_ms": 1e3 * c.percentile(lat, 99),
        "sample_max_ms": 1e3 * max(lat, default=float("nan")),
        "connections_min": min(conns, default=0),
        "connections_max": max(conns, default=0),
        "publishes": len(publish_s),
        "publish_p50_ms": 1e3 * c.percentile(publish_s, 50) if publish_s else None,
        "publish_max_ms": 1e3 * max(publish_s) if publish_s else None,
        "served_mb_per_s": c.rate(served / 1e6, elapsed),
        "learner_cores": c.rate(cpu, elapsed),
        "loadavg": c.loadavg(),
        "errors": [],
    }
    if crowd is not None:
        out.update(_crowd_summary(crowd, out, elapsed, nbytes(tree)))
        if any(n != nice for n in out["crowd_nice"]):
            out["errors"].append(f"fetchers at niceness {out['crowd_nice']}, not {nice}")
    log(
        f"{name}: ingress {out['ingress_per_s']:,.0f} samples/s (read "
        f"{out['consumed_per_s']:,.0f}), sample p50 {out['sample_p50_ms']:.3f} p99 "
        f"{out['sample_p99_ms']:.2f} ms, learner {out['learner_cores']:.2f} cores, "
        f"connections {out['connections_min']}.."
        f"{out['connections_max']}, {out['served_mb_per_s']:,.0f} MB/s served "
        f"{out['errors'][:2]}"
    )
    return out


def _crowd_summary(
    crowd: c.LineWorkers, phase: dict[str, Any], elapsed: float, size: int
) -> dict[str, Any]:
    """The crowd processes' reports of a phase, merged: fetches, fairness, torn copies."""
    reports = [
        json.loads(x.split(" ", 1)[1])
        for x in crowd.expect("result", START_AHEAD_S + CROWD_GRACE_S + CALL_S)
    ]
    errors = list(phase["errors"])
    per_conn: list[int] = []
    firsts: list[float] = []
    fetch_ms: list[float] = []
    for i, r in enumerate(reports):
        if r["error"]:
            errors.append(f"crowd {i}: {r['error']}")
        per_conn += [int(x) for x in r.get("fetches", [])]
        firsts += [float(x) for x in r.get("first_fetch_s", []) if x is not None]
        fetch_ms += [float(x) for x in r.get("fetch_ms", [])]
        errors += [f"crowd {i}: {e}" for e in r.get("errors", [])]
        if r.get("stuck_threads"):
            errors.append(f"crowd {i}: {r['stuck_threads']} fetch threads never ended")

    def total(key: str) -> int:
        return sum(int(r.get(key, 0)) for r in reports)

    torn, backwards = total("torn_copies"), total("backwards")
    if torn:
        errors.append(f"{torn} torn copies ({total('torn_leaves')} leaves)")
    if backwards:
        errors.append(f"a fetcher's version went back {backwards} times")
    fetches = sum(per_conn)
    with_one = sum(1 for x in per_conn if x > 0)
    return {
        "fetchers": len(per_conn),
        "crowd_nice": [r.get("nice") for r in reports],
        "fetches": fetches,
        "fetches_per_s": c.rate(fetches, elapsed),
        "fetched_mb_per_s": c.rate(fetches * size / 1e6, elapsed),
        "per_connection_min": min(per_conn, default=0),
        "per_connection_median": c.median([float(x) for x in per_conn]),
        "per_connection_max": max(per_conn, default=0),
        "with_a_fetch": with_one,
        # How many connections completed 0, 1, 2, ... fetches; each process's fetches.
        "per_connection_histogram": [
            per_conn.count(k) for k in range(max(per_conn, default=0) + 1)
        ],
        "per_process": [sum(int(x) for x in r.get("fetches", [])) for r in reports],
        "with_a_fetch_share": with_one / len(per_conn) if per_conn else 0.0,
        "first_fetch_max_s": max(firsts, default=None),
        "fetch_p50_ms": c.percentile(fetch_ms, 50),
        "fetch_p99_ms": c.percentile(fetch_ms, 99),
        "late": total("late"),
        "timeouts": total("timeouts"),
        "fetch_errors": total("error_count"),
        "torn_copies": torn,
        "torn_leaves": total("torn_leaves"),
        "backwards": backwards,
        "errors": errors,
    }


def _crowd_sizes(fetchers: int, processes: int) -> list[int]:
    """``fetchers`` connections over ``processes`` processes, as evenly as they go."""
    k = max(1, min(processes, fetchers))
    return [fetchers // k + (i < fetchers % k) for i in range(k)]


CPU_CGROUP = Path("/sys/fs/cgroup/cpu")  # the cgroup-v1 cpu hierarchy
LOW_SHARES = 2  # the least cpu.shares: CPU only when every other group leaves it


@contextlib.contextmanager
def low_cpu_weight(pids: list[int]) -> Iterator[str | None]:
    """Puts the processes ``pids`` (every thread) in a new cgroup-v1 ``cpu`` group of
    ``cpu.shares`` ``LOW_SHARES`` for the block; yields ``None``, or why that could not be
    done (then nothing was changed). After the block they go back to the root group, and the
    group is removed."""
    group = CPU_CGROUP / f"echo-crowd-{os.getpid()}"
    moved: list[int] = []
    try:
        group.mkdir()
    except OSError as e:
        yield f"no cpu cgroup: {e}"
        return
    try:
        try:
            (group / "cpu.shares").write_text(str(LOW_SHARES))
            for pid in pids:
                (group / "cgroup.procs").write_text(str(pid))
                moved.append(pid)
        except OSError as e:
            yield f"cpu cgroup: {e}"
            return
        yield None
    finally:
        for pid in moved:
            with contextlib.suppress(OSError):  # a process that ended meanwhile
                (CPU_CGROUP / "cgroup.procs").write_text(str(pid))
        with contextlib.suppress(OSError):
            group.rmdir()


def measure(params: dict[str, Any]) -> dict[str, Any]:
    return c.under_watchdog(limit_s(params), lambda: _measure(params))


def _measure(params: dict[str, Any]) -> dict[str, Any]:
    """The three phases against one server, its consumer thread and its feeders."""
    nofile = raise_nofile()
    size_arg, n_fetch = int(params["bytes"]), int(params["fetchers"])
    server = Server(
        sample_example(), int(params["batch_size"]), transport=TcpTransport(port=0, host=HOST)
    )
    server.start()
    assert server.port is not None
    limit = limit_s(params)
    guard = c.call_later(limit - 30.0, server.close)
    tree = pytree(size_arg, seed=1)
    stamp(tree, 1)
    server.publish(tree)
    consumer = Consumer(server, limit)
    k_feed = int(params["feeders"])
    feed = c.LineWorkers(
        [[*MODULE, "--feeder", str(server.port), str(w)] for w in range(k_feed)], ROOT
    )
    crowd: c.LineWorkers | None = None
    phases: list[dict[str, Any]] = []
    errors: list[str] = []
    sent: dict[int, int] = {}
    connected = 0
    try:
        feed.expect("ready", READY_TIMEOUT_S)
        start = time.monotonic() + START_AHEAD_S
        feed.tell(f"go {start!r} {start + limit!r}")  # stopped below; the deadline a bound
        time.sleep(max(0.0, start + WARMUP_S - time.monotonic()))
        phases.append(run_phase(server, consumer, "baseline", tree, params, None))
        sizes = _crowd_sizes(n_fetch, int(params["processes"]))
        crowd = c.LineWorkers(
            [[*MODULE, "--crowd", str(server.port), str(size_arg), str(n)] for n in sizes],
            ROOT,
        )
        t = time.monotonic()
        ready = [x.split(" ", 2) for x in crowd.expect("ready", 3 * READY_TIMEOUT_S)]
        connected = sum(int(x[1]) for x in ready)
        errors += [f"crowd {i}: {json.loads(x[2])}" for i, x in enumerate(ready) if x[2] != '""']
        log(f"{connected} of {n_fetch} fetchers connected in {time.monotonic() - t:.1f} s")
        if connected < n_fetch:
            errors.append(f"only {connected} of {n_fetch} fetcher connections opened")
        phases.append(run_phase(server, consumer, "idle", tree, params, None))
        nices = sorted(int(n) for n in params["nice"])  # unprivileged, it only goes up
        for nice in nices:
            phases.append(run_phase(server, consumer, "crowd", tree, params, crowd, nice))
        if params["cgroup"]:
            with low_cpu_weight([p.pid for p in crowd.procs]) as why:
                if why is None:
                    last = nices[-1] if nices else 0
                    phase = run_phase(server, consumer, "cgroup", tree, params, crowd, last)
                    phases.append(phase)
                else:
                    log(f"no cgroup phase: {why}")
        # Stop the feeders; the consumer reads on until they have flushed and reported.
        feed.tell("stop")
        results = [json.loads(x.split(" ", 1)[1]) for x in feed.expect("result", CALL_S)]
        sent = {int(r["wid"]): int(r["sent"]) for r in results}
        errors += [f"feeder {r['wid']}: {r['error']}" for r in results if r["error"]]
    finally:
        guard.cancel()
        consumer.close()
        feed.stop()
        if crowd is not None:
            crowd.stop()
        server.close()
    for p in phases:
        errors += [f"{p['phase']}: {e}" for e in p["errors"]]
    errors += consumer.errors + consumer.reader.check(sent)
    base = phases[0]["ingress_per_s"] if phases else None
    for p in phases:
        p["ratio_to_baseline"] = p["ingress_per_s"] / base if base else None
    return {
        "bytes": nbytes(tree),
        "sample_bytes": sample_bytes(),
        "feeders": k_feed,
        "fetchers": n_fetch,
        "processes": len(_crowd_sizes(n_fetch, int(params["processes"]))),
        "connected": connected,
        "nofile": nofile,
        "phases": phases,
        "sent": sum(sent.values()),
        "received": consumer.reader.received,
        "errors": errors,
        "correct": not errors,
    }


# --------------------------------------------------------------------------- the suite


def parameters(quick: bool) -> dict[str, Any]:
    return {
        "bytes": 1_000_000,
        "fetchers": 200 if quick else 1000,
        "processes": 4 if quick else 8,
        "feeders": 2,
        "publish_hz": 10.0,
        "batch_size": 32,
        "seconds": 5.0,
        "nice": [0, 19],
        "cgroup": True,
    }


def limit_s(params: dict[str, Any]) -> float:
    crowds = len(params["nice"]) + bool(params["cgroup"])
    phases = (2 + crowds) * (float(params["seconds"]) + START_AHEAD_S + 5.0)
    ready = 4 * READY_TIMEOUT_S  # the feeders, then the crowd processes (3x)
    return phases + ready + crowds * CROWD_GRACE_S + 2 * CALL_S + 60.0


COLUMNS = [
    "echo",
    "phase",
    "fetchers",
    "connections open",
    "ingress samples/s",
    "/ baseline",
    "fetches/s",
    "MB/s served",
    "fetches per connection min / median / max",
    "sample() p50 / p99 ms",
    "correct",
]
PHASES = {
    "baseline": "baseline: feeders only",
    "idle": "fetchers connected, idle",
    "crowd": "fetching back to back, fetchers at nice {nice}",
    "cgroup": f"the same, fetchers at nice {{nice}} and cpu.shares {LOW_SHARES}",
}


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    rows = c.failed_rows(results, len(COLUMNS))
    notes: list[str] = []
    for side, r in results.items():
        if "error" in r:
            continue
        ok = "yes" if r["correct"] else "no"
        for p in r["phases"]:
            crowd = p["phase"] in ("crowd", "cgroup")
            rows.append(
                [
                    side,
                    PHASES.get(str(p["phase"]), str(p["phase"])).format(nice=p.get("nice")),
                    str(r["connected"] if p["phase"] != "baseline" else 0),
                    f"{p['connections_min']:,}..{p['connections_max']:,}",
                    c.num(p["ingress_per_s"]),
                    c.num(p.get("ratio_to_baseline"), ".2f"),
                    c.num(p.get("fetches_per_s")) if crowd else "-",
                    c.num(p["served_mb_per_s"]) if crowd else "-",
                    (
                        f"{p['per_connection_min']} / {p['per_connection_median']:g} / "
                        f"{p['per_connection_max']}"
                        if crowd
                        else "-"
                    ),
                    f"{c.num(p['sample_p50_ms'], '.2f')} / {c.num(p['sample_p99_ms'], '.2f')}",
                    ok,
                ]
            )
            if crowd:
                shares = f", cpu.shares {LOW_SHARES}" if p["phase"] == "cgroup" else ""
                notes.append(
                    f"*{side}, nice {p['nice']}{shares}*: {p['fetches']:,} whole fetches of "
                    f"{p['fetchers']:,} connections, {p['with_a_fetch_share']:.1%} of them "
                    f"with at least one (the longest wait for a first one "
                    f"{c.num(p['first_fetch_max_s'], '.2f')} s); a fetch took "
                    f"{c.num(p['fetch_p50_ms'], '.0f')} ms at the median, "
                    f"{c.num(p['fetch_p99_ms'], '.0f')} ms at p99; {p['torn_copies']} torn "
                    f"copies, {p['timeouts']} timeouts, {p['fetch_errors']} errors; the "
                    f"learner's process used {c.num(p['learner_cores'], '.2f')} cores "
                    f"(baseline {c.num(r['phases'][0]['learner_cores'], '.2f')})."
                )
    mb = int(params["bytes"]) / 1e6
    return [
        {
            "title": f"A crowd fetching {mb:g} MB of parameters: {params['fetchers']:,} "
            f"connections in {params['processes']} processes, {params['feeders']} feeder "
            f"processes (141 B samples), batch {params['batch_size']}, "
            f"{params['seconds']:g} s per phase",
            "columns": COLUMNS,
            "rows": rows,
            "notes": [
                "*ingress samples/s*: samples into the learner's ring "
                "(`samples_inserted_total`), the 2 feeders sending as fast as the server "
                "takes them and a consumer thread reading every batch. *connections open*: "
                "`active_connections`, polled (min..max). *fetches/s*: whole copies "
                "completed in the phase, every connection fetching back to back in a thread "
                "of its own; *MB/s served*: `params_bytes_served_total`. *fetches per "
                "connection*: of each fetcher connection in the phase. *sample()*: the "
                "consumer's latency, which waits for a full batch when the ingress lags.",
                *notes,
            ],
        }
    ]
