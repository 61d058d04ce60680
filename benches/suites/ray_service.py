"""echo on Ray (``echo.ray``): shards, discovery, restarts, on a local Ray cluster on loopback.

Everything runs on a ``ray.cluster_utils.Cluster`` started here (``nodes`` nodes, all
``node_ip_address="127.0.0.1"``, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` so every byte stays
on loopback) and shut down at the end; the actors are the classes below. Five parts:

* **Shards**: for each count in ``shards``, that many learner actors (``shard_server``, a FIFO
  of ``batch_size``, a consumer thread reading every batch's ids) and ``workers`` worker
  actors (``echo.ray.connect``, balanced over the shards by the registry's rule), each
  sending ``send_batch`` of ``batch_size`` rows of a nested sample (6 leaves, ~1.9 KB) from a
  pool of distinct rows, ids numbered, for ``seconds`` from a common start. Reported: the
  aggregate and per-shard samples/s (sent in the window, divided by the time until the last
  acknowledgement), and the learners' and workers' process CPU per sample. Checked: each
  shard's learner consumed exactly the count and id sum its workers had acknowledged. Every
  actor shares this machine's cores, so where there are few of them aggregate scaling cannot
  show: the cores, not the shards, bound it.
* **connect vs TcpClient**: in this process, one FIFO server served as a shard, and rounds of
  per-sample ``send`` for ``compare_seconds`` through a plain ``TcpClient``, a ``TcpClient``
  with ``reconnect=True`` (what a ``ShardClient`` is underneath) and ``echo.ray.connect``,
  the order rotating from repeat to repeat; the median of the per-repeat ratios to the plain
  client.
* **Discovery plus connect**: ``connect_clients`` ``ShardClient``s opened by
  ``connect_procs`` actors (``connect_threads`` threads each), timed from the moment
  ``echo.ray.status`` first lists the service's shard (the registry answering) to the last
  client connected. Also the registry's call latency (sequential) and rate (``registry_calls``
  calls at once), the learner's CPU and RSS per idle connection (``idle_seconds`` with and
  without the clients), and its CPU per sample when every client sends one sample in turn
  for ``spread_rounds`` rounds (many light connections, the regime of thousands of workers).
* **Resume after a restart**: a learner actor (``max_restarts=1``, periodic checkpoints every
  ``checkpoint_every`` s) streaming from ``restart_workers`` worker actors is killed with
  ``ray.kill(actor, no_restart=False)``; Ray restarts it, ``shard_server`` restores the newest
  checkpoint and registers generation 2. Reported: kill to registration, and registration
  (the learner's clock, and when polling ``echo.ray.status`` first saw it) to each worker's
  first sample acknowledged by generation 2 (the slowest worker).
* **Model**: the tables' last one applies the measured per-sample and per-connection costs to
  ``model_learners`` learners and ``model_workers`` workers (docs/design/index.md, "Scaling
  model for echo on Ray", says how and under which assumptions).

Run: ``python -m benches ray [--quick]``. Needs Ray (the ``distributed`` extra). Every loop is
bounded in count and time, every Ray call has a timeout; the cluster is shut down (it and
the actors are the only processes this suite starts).

This module holds the parameters, the cluster and the parts; the actors and the samples they
move are in :mod:`benches.suites.ray_actors`, the tables in :mod:`benches.suites.ray_tables`.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from typing import Any

from benches import common as c
from benches.suites.ray_actors import (
    CALL_S,
    MAX_LOOPS,
    NAMESPACE,
    Connector,
    Consumer,
    Sender,
    ShardLearner,
    Streamer,
    example,
    pool,
    row,
    sample_bytes,
)
from benches.suites.ray_tables import tables

__all__ = ["limit_s", "measure", "parameters", "tables"]  # the suite protocol


def parameters(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "nodes": 1,
            "shards": [1, 2, 4],
            "workers": 4,
            "batch_size": 32,
            "inflight": 128,
            "seconds": 1.5,
            "compare_seconds": 1.0,
            "compare_repeats": 3,
            "connect_clients": 256,
            "connect_procs": 4,
            "connect_threads": 4,
            "registry_calls": 1000,
            "idle_seconds": 2.0,
            "spread_rounds": 64,
            "restart_workers": 2,
            "checkpoint_every": 0.5,
            "shared_memory": False,
            "model_learners": 8,
            "model_workers": 4096,
            "model_nic_gbit": 25.0,
        }
    return {
        "nodes": 2,
        "shards": [1, 2, 4],
        "workers": 8,
        "batch_size": 32,
        "inflight": 128,
        "seconds": 5.0,
        "compare_seconds": 2.0,
        "compare_repeats": 5,
        "connect_clients": 256,
        "connect_procs": 4,
        "connect_threads": 4,
        "registry_calls": 5000,
        "idle_seconds": 3.0,
        "spread_rounds": 256,
        "restart_workers": 4,
        "checkpoint_every": 0.5,
        "shared_memory": False,
        "model_learners": 8,
        "model_workers": 4096,
        "model_nic_gbit": 25.0,
    }


def limit_s(params: dict[str, Any]) -> float:
    cluster = 90.0 + 30.0 * int(params["nodes"])
    shards = sum(60.0 + 2.0 * float(params["seconds"]) for _ in params["shards"])
    compare = int(params["compare_repeats"]) * 3 * (float(params["compare_seconds"]) + 15.0)
    connect = 120.0 + 3 * float(params["idle_seconds"])
    restart = 150.0
    return cluster + shards + compare + connect + restart


# --------------------------------------------------------------------------- the cluster


class _Run:
    """The cluster, the driver's Ray connection, and every actor and service made, so that
    ``end()`` takes them all down."""

    def __init__(self, params: dict[str, Any]) -> None:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before `import ray`
        import ray
        from ray.cluster_utils import Cluster

        self.ray = ray
        self.nodes = int(params["nodes"])
        self.actors: list[Any] = []
        self.services: list[str] = []
        env = {
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(c.ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        }
        store = 96 * c.MIB
        t0 = time.monotonic()
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 2,
                "node_ip_address": c.HOST,
                "include_dashboard": False,
                "object_store_memory": store,
                "resources": {"node0": 10_000},
            },
        )
        try:
            for k in range(1, self.nodes):
                self.cluster.add_node(
                    num_cpus=2,
                    node_ip_address=c.HOST,
                    object_store_memory=store,
                    resources={f"node{k}": 10_000},
                )
            ray.init(
                address=self.cluster.address,
                namespace="echo-bench-driver",
                runtime_env={"env_vars": env},
                log_to_driver=False,
            )
        except BaseException:
            self.cluster.shutdown()
            raise
        self.start_s = time.monotonic() - t0

    def get(self, refs: Any, timeout: float = CALL_S) -> Any:
        return self.ray.get(refs, timeout=timeout)

    def get_restarted(self, method: Any, timeout: float = CALL_S) -> Any:
        """`method.remote()` of an actor Ray is restarting: its calls fail fast (the actor is
        unavailable) until its `__init__` has returned, which can be a moment after its
        server registered."""
        deadline = time.monotonic() + timeout
        for _ in range(MAX_LOOPS):
            try:
                return self.ray.get(method.remote(), timeout=timeout)
            except self.ray.exceptions.ActorUnavailableError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.02)
        raise TimeoutError("the restarted actor never answered")

    def actor(self, cls: type, node: int, *args: Any, restarts: int = 0, **kw: Any) -> Any:
        handle = (
            self.ray.remote(cls)
            .options(
                num_cpus=0,
                resources={f"node{node % self.nodes}": 1},
                max_restarts=restarts,
                max_task_retries=0,
            )
            .remote(*args, **kw)
        )
        self.actors.append(handle)
        return handle

    def kill(self, actors: list[Any]) -> None:
        for a in actors:
            with contextlib.suppress(Exception):
                self.ray.kill(a, no_restart=True)
            if a in self.actors:
                self.actors.remove(a)

    def end_service(self, service: str) -> None:
        import echo.ray

        with contextlib.suppress(Exception):
            echo.ray.shutdown_service(service, namespace=NAMESPACE)
        if service in self.services:
            self.services.remove(service)

    def end(self) -> None:
        self.kill(list(self.actors))
        for service in list(self.services):
            self.end_service(service)
        with contextlib.suppress(Exception):
            self.ray.shutdown()
        self.cluster.shutdown()


# --------------------------------------------------------------------------- parts


def _shards_round(run: _Run, n: int, params: dict[str, Any], tmp: str) -> dict[str, Any]:
    import echo.ray

    service = f"bench-shards-{n}"
    run.services.append(service)
    bs, w = int(params["batch_size"]), int(params["workers"])
    learners = [
        run.actor(ShardLearner, k, service, k, os.path.join(tmp, f"{service}-{k}"), bs, 3600.0)
        for k in range(n)
    ]
    senders: list[Any] = []
    try:
        run.get([a.info.remote() for a in learners])
        for i in range(w):  # one after another: the registry's rule balances them
            senders.append(
                run.actor(
                    Sender, i, service, bs, int(params["inflight"]), i, params["shared_memory"]
                )
            )
            run.get(senders[-1].shard.remote())
        shards = run.get([s.shard.remote() for s in senders])
        status = {s.shard: s.workers for s in echo.ray.status(service, namespace=NAMESPACE)}
        before = run.get([a.counters.remote() for a in learners])
        start = time.time() + 0.5
        seconds = float(params["seconds"])
        sent = run.get(
            [s.run.remote(start, seconds, (i + 1) * 10**12) for i, s in enumerate(senders)],
            timeout=CALL_S + seconds,
        )
        expect = {k: sum(r["acked"] for r in sent if r["shard"] == k) for k in range(n)}
        after = run.get([a.wait_count.remote(expect[k], 30.0) for k, a in enumerate(learners)])
        closed = run.get([s.close.remote() for s in senders])
    finally:
        run.kill(senders + learners)
        run.end_service(service)
    t_end = max(r["done_unix_s"] for r in sent)
    t_start = min(r["start_unix_s"] for r in sent)
    per_shard = []
    correct = all(closed) and all(r["sent"] == r["acked"] for r in sent)
    for k in range(n):
        mine = [r for r in sent if r["shard"] == k]
        count = after[k]["count"] - before[k]["count"]
        id_sum = after[k]["id_sum"] - before[k]["id_sum"]
        ok = count == expect[k] and id_sum == sum(r["id_sum"] for r in mine)
        correct = correct and ok
        span = max((r["done_unix_s"] for r in mine), default=t_end) - min(
            (r["start_unix_s"] for r in mine), default=t_start
        )
        per_shard.append(
            {
                "shard": k,
                "workers": len(mine),
                "samples": count,
                "per_s": count / span if span > 0 else None,
                "learner_cpu_us": (after[k]["cpu_s"] - before[k]["cpu_s"]) / count * 1e6
                if count
                else None,
                "correct": ok,
            }
        )
    total = sum(r["acked"] for r in sent)
    return {
        "shards": n,
        "workers": w,
        "balance": sorted(status.get(k, 0) for k in range(n)),
        "assigned": shards,
        "paths": sorted({r["path"] for r in sent}),
        "samples": total,
        "window_s": t_end - t_start,
        "per_s": total / (t_end - t_start),
        "per_shard": per_shard,
        "learner_cpu_us": sum(after[k]["cpu_s"] - before[k]["cpu_s"] for k in range(n))
        / max(1, total)
        * 1e6,
        "worker_cpu_us": sum(r["cpu_s"] for r in sent) / max(1, total) * 1e6,
        "correct": correct,
    }


def _compare(run: _Run, params: dict[str, Any]) -> dict[str, Any]:
    """Per-sample send through a plain TcpClient, one with reconnect=True, and
    echo.ray.connect, to one server in this process, rounds rotating."""
    import echo
    import echo.ray

    service = "bench-compare"
    run.services.append(service)
    bs = int(params["batch_size"])
    server = echo.Server(example(), bs, echo.TcpTransport(port=0, host=c.HOST))
    server.start()
    echo.ray.serve(server, service, 0, namespace=NAMESPACE)
    consumer = Consumer(server)
    samples = pool(64, 3)
    rows = [row(samples, i) for i in range(64)]
    shm = bool(params["shared_memory"])
    inflight = int(params["inflight"])

    def make(variant: str) -> Any:
        if variant == "ray.connect":
            return echo.ray.connect(
                service, example(), inflight, namespace=NAMESPACE, shared_memory=shm
            )
        return echo.TcpClient(
            c.HOST,
            server.port or 0,
            example(),
            inflight,
            protocol=2,
            reconnect=variant == "TcpClient reconnect",
            shared_memory=shm,
        )

    variants = ["TcpClient", "TcpClient reconnect", "ray.connect"]
    rounds: list[dict[str, Any]] = []
    seconds = float(params["compare_seconds"])
    total = 0
    try:
        for rep in range(int(params["compare_repeats"])):
            order = variants[rep % 3 :] + variants[: rep % 3]
            for variant in order:
                client = make(variant)
                try:
                    n = 0
                    t0 = time.perf_counter()
                    end = t0 + seconds
                    for _ in range(MAX_LOOPS):
                        for r in rows[:bs]:
                            client.send(r, timeout=60.0)
                        n += bs
                        if time.perf_counter() >= end:
                            break
                    client.wait(timeout=60.0)
                    dt = time.perf_counter() - t0
                    ok = client.acked == n
                finally:
                    client.close(timeout=30.0)
                total += n
                rounds.append(
                    {"repeat": rep, "variant": variant, "samples": n, "per_s": n / dt, "ok": ok}
                )
        deadline = time.monotonic() + 30.0
        for _ in range(MAX_LOOPS):
            if consumer.count >= total or time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        consumed = consumer.count
    finally:
        server.close()
        consumer.end()
        run.end_service(service)
    ratios: dict[str, list[float]] = {}
    for rep in range(int(params["compare_repeats"])):
        mine = {r["variant"]: r["per_s"] for r in rounds if r["repeat"] == rep}
        for v in variants[1:]:
            ratios.setdefault(v, []).append(mine[v] / mine["TcpClient"])
        ratios.setdefault("ray.connect/reconnect", []).append(
            mine["ray.connect"] / mine["TcpClient reconnect"]
        )
    return {
        "rounds": rounds,
        "ratios": ratios,
        "consumed": consumed,
        "sent": total,
        "correct": consumed == total and all(r["ok"] for r in rounds),
    }


def _registry_calls(run: _Run, service: str, calls: int) -> dict[str, Any]:
    """Latency of one registry lookup (sequential) and the rate of ``calls`` at once."""
    import echo.ray

    # The registry's handle as clients get it (an internal of echo.ray: one actor per service).
    registry = echo.ray._registry(service, NAMESPACE, create=False)
    seq = []
    for _ in range(min(200, calls)):
        t = time.perf_counter()
        run.get(registry.lookup.remote(0))
        seq.append(time.perf_counter() - t)
    t = time.perf_counter()
    run.get([registry.lookup.remote(0) for _ in range(calls)])
    dt = time.perf_counter() - t
    return {
        "lookup_ms_p50": c.median(seq) * 1e3,
        "lookup_ms_p99": c.percentile(seq, 99) * 1e3,
        "concurrent_calls": calls,
        "calls_per_s": calls / dt,
    }


def _connect(run: _Run, params: dict[str, Any], tmp: str) -> dict[str, Any]:
    import echo.ray

    service = "bench-connect"
    run.services.append(service)
    n, procs = int(params["connect_clients"]), int(params["connect_procs"])
    threads, idle = int(params["connect_threads"]), float(params["idle_seconds"])
    shm = bool(params["shared_memory"])
    connectors = [run.actor(Connector, i) for i in range(procs)]
    learner = None
    try:
        run.get([x.ready.remote() for x in connectors])
        bs = math.gcd(n, 32)  # every client sends as many: whole batches
        learner = run.actor(ShardLearner, 0, service, 0, os.path.join(tmp, service), bs, 3600.0)
        run.get(learner.info.remote())  # registered
        idle0 = run.get(learner.idle_cpu.remote(idle))  # the learner without connections
        # The clock starts when the registry answers a status() listing the shard.
        shards = echo.ray.status(service, namespace=NAMESPACE)
        answered = time.time()
        if not shards:
            raise RuntimeError(f"{service}: the registry lists no shard after registration")
        shares = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
        made = run.get(
            [
                x.connect_many.remote(service, k, threads, shm)
                for x, k in zip(connectors, shares, strict=True)
            ]
        )
        connected = max(m["done_unix_s"] for m in made) - answered
        acked = sum(run.get([x.send_one_each.remote() for x in connectors]))
        idle_n = run.get(learner.idle_cpu.remote(idle))
        # Every connection carrying a little: the learner's CPU per sample with many of them.
        rounds = int(params["spread_rounds"])
        before = run.get(learner.counters.remote())
        spread = run.get([x.send_rounds.remote(rounds) for x in connectors])
        expect = before["count"] + n * rounds
        after = run.get(learner.wait_count.remote(expect, 30.0))
        registry = _registry_calls(run, service, int(params["registry_calls"]))
        closed = sum(run.get([x.close_all.remote() for x in connectors]))
    finally:
        run.kill(connectors + ([learner] if learner is not None else []))
        run.end_service(service)
    each = [dt for m in made for dt in m["connect_s"]]
    per_conn_cpu = (idle_n["cpu_s"] / idle_n["wall_s"] - idle0["cpu_s"] / idle0["wall_s"]) / max(
        1, idle_n["connections"]
    )
    return {
        "clients": n,
        "procs": procs,
        "threads": threads,
        "connected_s": connected,
        "first_start_after_answer_s": min(m["started_unix_s"] for m in made) - answered,
        "connect_ms_p50": c.median(each) * 1e3,
        "connect_ms_p99": c.percentile(each, 99) * 1e3,
        "acked": acked,
        "connections_at_learner": idle_n["connections"],
        "idle_cpu_us_per_conn_s": per_conn_cpu * 1e6,
        "rss_kib_per_conn": (idle_n["rss_mib"] - idle0["rss_mib"]) * 1024 / max(1, n),
        "registry": registry,
        "spread_samples": n * rounds,
        "spread_per_s": n
        * rounds
        / (max(x["done_unix_s"] for x in spread) - min(x["start_unix_s"] for x in spread)),
        "spread_learner_cpu_us": (after["cpu_s"] - before["cpu_s"]) / max(1, n * rounds) * 1e6,
        "correct": acked == n
        and closed == n
        and idle_n["connections"] == n
        and after["count"] == expect,
    }


def _restart(run: _Run, params: dict[str, Any], tmp: str) -> dict[str, Any]:
    import echo.ray

    service = "bench-restart"
    run.services.append(service)
    k = int(params["restart_workers"])
    shm = bool(params["shared_memory"])
    ckpt = os.path.join(tmp, service)
    learner = run.actor(
        ShardLearner, 0, service, 0, ckpt, 1, float(params["checkpoint_every"]), restarts=1
    )
    streamers: list[Any] = []
    try:
        before = run.get(learner.info.remote())
        streamers = [
            run.actor(Streamer, i, service, int(params["inflight"]), shm) for i in range(k)
        ]
        run.get([s.start.remote(CALL_S) for s in streamers])
        deadline = time.monotonic() + 60.0
        for _ in range(MAX_LOOPS):  # a periodic checkpoint while they stream
            if run.get(learner.checkpoints.remote()) >= 1 or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        time.sleep(0.3)
        run.ray.kill(learner, no_restart=False)
        killed = time.time()
        polled = None
        deadline = time.monotonic() + CALL_S
        for _ in range(MAX_LOOPS):  # the new generation's registration, as status() shows it
            shards = echo.ray.status(service, namespace=NAMESPACE)
            if shards and shards[0].generation >= 2:
                polled = time.time()
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        after = run.get_restarted(learner.info)
        states: list[dict[str, Any]] = []
        deadline = time.monotonic() + 60.0
        for _ in range(MAX_LOOPS):  # every worker's first ack from generation 2
            states = run.get([s.state.remote() for s in streamers])
            if all("2" in s["first_ack"] for s in states) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        finals = run.get([s.close.remote() for s in streamers])
    finally:
        with contextlib.suppress(Exception):  # its periodic checkpoints stop
            run.get(learner.close.remote(), timeout=30.0)
        run.kill([*streamers, learner])
        run.end_service(service)
    firsts = [s["first_ack"].get("2") for s in states]
    last = max((f for f in firsts if f is not None), default=None)
    resumed = last is not None and all(f is not None for f in firsts)
    registered = after["registered_unix_s"]
    return {
        "workers": k,
        "checkpoint_every": float(params["checkpoint_every"]),
        "restored": after["restored"],
        "generation": after["generation"],
        "pid_changed": after["pid"] != before["pid"],
        "kill_to_registered_s": registered - killed,
        "registered_to_polled_s": None if polled is None else polled - registered,
        "resume_s": last - registered if resumed and last is not None else None,
        "resume_after_poll_s": last - polled
        if resumed and last is not None and polled is not None
        else None,
        "resume_each_s": [None if f is None else f - registered for f in firsts],
        "reconnects": [s["reconnects"] for s in finals],
        "errors": [s["error"] for s in finals if s["error"]],
        "correct": resumed
        and bool(after["restored"])
        and after["generation"] == 2
        and all(s["flushed"] and not s["error"] for s in finals),
    }


def measure(params: dict[str, Any]) -> dict[str, Any]:
    timer = c.watchdog(limit_s(params))
    try:
        # Removed once the cluster is down: no learner writes a checkpoint into it then.
        with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
            run = _Run(params)
            out: dict[str, Any] = {"cluster_start_s": run.start_s, "sample_bytes": sample_bytes()}
            try:
                out["shards"] = [_shards_round(run, int(n), params, tmp) for n in params["shards"]]
                out["compare"] = _compare(run, params)
                out["connect"] = _connect(run, params, tmp)
                out["restart"] = _restart(run, params, tmp)
            finally:
                run.end()
    finally:
        timer.cancel()
    out["cpus"] = os.cpu_count()
    out["loadavg"] = c.loadavg()
    out["correct"] = (
        all(r["correct"] for r in out["shards"])
        and out["compare"]["correct"]
        and out["connect"]["correct"]
        and out["restart"]["correct"]
    )
    return out
