"""The other end of the TCP benchmark's loopback (:mod:`benches.suites.core_tcp`): the worker
(connect a ``TcpClient``, report ready, wait for the common start, send until the common
deadline, flush and report), its two launchers (``multiprocessing`` forkserver processes, or
Ray actors in a local Ray instance), and the raw loopback blast that is the reference for
the TCP numbers. Each worker has a watchdog; the launchers end (by PID) what they started.
"""

from __future__ import annotations

import importlib
import os
import queue
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from benches import common as h
from benches.suites.core_tcp_scenarios import (
    HOST,
    ID_MOD,
    MAX_INFLIGHT,
    SCENARIO_BY_NAME,
    WorkerArgs,
    err_text,
    has_shared_memory,
    learner_echo_file,
    worker_watchdog,
)
from echo import TcpClient

# --------------------------------------------------------------------------- worker


@dataclass
class _Sender:
    """A worker's connected client and its sample, whose leaves it rewrites before each send."""

    a: WorkerArgs
    client: TcpClient
    tree: dict[str, np.ndarray]
    heads: list[np.ndarray]  # views; [0] carries seq % ID_MOD


def _worker_limit_s(a: WorkerArgs) -> float:
    """A worker's whole life at most: waiting for the start, sending, flushing."""
    return a.go_timeout_s + a.warmup_s + a.seconds + a.flush_timeout_s + 10.0


def _worker_connect(a: WorkerArgs) -> tuple[_Sender | None, dict[str, Any]]:
    """Checks the echo build and connects: (the sender, or None with the error in the report;
    the worker's report)."""
    res: dict[str, Any] = {"wid": a.wid, "sent": 0, "error": None, "cpu_s": 0.0, "send_s": 0.0}
    if learner_echo_file() != a.echo_file:
        res["error"] = (
            f"worker imported echo from {learner_echo_file()}, learner from {a.echo_file}"
        )
        return None, res
    sc = SCENARIO_BY_NAME[a.scenario]
    tree = sc.example()
    rng = np.random.default_rng(a.wid)
    for k, _ in sc.leaves:
        leaf = sc.leaf(tree, k)
        leaf[...] = rng.random(leaf.shape, dtype=np.float32)
    heads = [sc.leaf(tree, k).reshape(-1) for k, _ in sc.leaves]
    kwargs: dict[str, Any] = {"max_inflight_msgs": MAX_INFLIGHT}
    if has_shared_memory():
        kwargs["shared_memory"] = sc.path == "shm"
    try:
        client = TcpClient(HOST, a.port, tree, **kwargs)
    except (OSError, ValueError, TypeError, RuntimeError) as e:
        res["error"] = f"connect: {err_text(e)}"
        return None, res
    path = getattr(client, "transport_path", "tcp")
    if path != sc.path:
        res["error"] = f"connected over {path}, the scenario is {sc.path}"
        client.close()
        return None, res
    return _Sender(a, client, tree, heads), res


def _worker_send(s: _Sender, t0: float | None, res: dict[str, Any]) -> dict[str, Any]:
    """The send loop: from ``t0`` (None: the start signal never came) until the common
    deadline or ``max_count`` samples, then wait for every ack and close. Fills ``res``."""
    a, client, meta, heads = s.a, s.client, s.tree["meta"], s.heads
    sent = 0
    try:
        if t0 is None:
            raise TimeoutError("no start signal from the learner")
        t_end = t0 + a.warmup_s + a.seconds
        clock = time.monotonic
        send = client.send
        tree = s.tree
        wid = float(a.wid)
        cpu0 = time.process_time()
        w0 = clock()
        while sent < a.max_count:
            v = float(sent % ID_MOD)
            for h in heads:
                h[0] = v
            meta[0] = wid
            meta[1] = sent
            now = clock()
            if now >= t_end:
                break
            meta[2] = now
            send(tree)
            sent += 1
        res["send_s"] = clock() - w0
        client.wait()  # 0.2.1's close() does not wait for acks
        res["cpu_s"] = time.process_time() - cpu0
    except (OSError, ValueError, TypeError, RuntimeError) as e:
        res["error"] = err_text(e)
    finally:
        res["sent"] = sent
        try:
            client.close()
        except (OSError, ValueError, TypeError, RuntimeError) as e:
            res["error"] = res["error"] or f"close: {err_text(e)}"
    return res


def _worker(
    a: WorkerArgs,
    go: Any,  # multiprocessing Event
    t0: Any,  # multiprocessing Value("d"): the common start time (time.monotonic())
    ready_q: Any,
    result_q: Any,
) -> None:
    """A worker process (``--launcher process``): connect, report ready, wait for the start
    signal, send, report."""
    worker_watchdog(_worker_limit_s(a), f"worker {a.wid}")
    sender, res = _worker_connect(a)
    ready_q.put((a.wid, sender is not None))
    if sender is not None:
        _worker_send(sender, t0.value if go.wait(a.go_timeout_s) else None, res)
    result_q.put(res)


class _RayWorker:
    """A worker as a Ray actor (``--launcher ray``), running the worker process's code: it
    connects when created, ``ready()`` reports that, ``run(t0)`` sends and returns the report.
    Decorated with ``ray.remote`` only once Ray is imported (it is optional)."""

    def __init__(self, a: WorkerArgs) -> None:
        worker_watchdog(_worker_limit_s(a), f"worker {a.wid}")
        self._sender, self._res = _worker_connect(a)

    def ready(self) -> bool:
        return self._sender is not None

    def run(self, t0: float) -> dict[str, Any]:
        if self._sender is not None:
            _worker_send(self._sender, t0, self._res)
            self._sender = None
        return self._res


# --------------------------------------------------------------------------- launchers


class ProcessWorkers:
    """K worker processes (``multiprocessing`` forkserver: the learner's interpreter and
    ``sys.path``); the start signal is a shared Event and start time."""

    def __init__(self, ctx: Any, args: list[WorkerArgs]) -> None:
        self._go = ctx.Event()
        self._t0 = ctx.Value("d", 0.0)
        self._ready_q, self._result_q = ctx.Queue(), ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(a, self._go, self._t0, self._ready_q, self._result_q),
                name=f"bench-tcp-worker-{a.wid}",
                daemon=True,
            )
            for a in args
        ]

    def start(self) -> None:
        for p in self._procs:
            p.start()

    def poll_ready(self, timeout: float) -> list[bool]:
        """Readiness reports that arrived within ``timeout`` (True: connected)."""
        try:
            return [bool(self._ready_q.get(timeout=timeout)[1])]
        except queue.Empty:
            return []

    def go(self, t0: float) -> None:
        self._t0.value = t0
        self._go.set()

    def poll_result(self, timeout: float) -> dict[str, Any] | None:
        """One worker's report, or None if none arrived within ``timeout``."""
        try:
            r: dict[str, Any] = self._result_q.get(timeout=timeout)
        except queue.Empty:
            return None
        return r

    def release(self) -> None:
        """The round is over: a worker still waiting for the start must not wait for its
        timeout (it starts with a deadline in the past and reports 0 sent)."""
        self._go.set()

    def stop(self) -> list[str]:
        """Joins the workers (10 s in all), terminates the rest; returns those that were stuck."""
        join_deadline = time.monotonic() + 10.0
        for p in self._procs:
            p.join(timeout=max(0.1, join_deadline - time.monotonic()))
        stuck = [f"pid {p.pid}" for p in self._procs if p.is_alive()]
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
        for q in (self._ready_q, self._result_q):
            q.close()
            q.join_thread()
        return stuck


class Workers(Protocol):
    """What a round needs from its K workers, however they were launched."""

    def start(self) -> None:
        """Launches them; each connects to the learner and reports whether it could."""

    def poll_ready(self, timeout: float) -> list[bool]:
        """Connection reports that arrived within ``timeout`` (True: connected)."""
        ...

    def go(self, t0: float) -> None:
        """The common start: send from ``t0`` (``time.monotonic()``) for warm-up + window."""

    def poll_result(self, timeout: float) -> dict[str, Any] | None:
        """One worker's final report, or None if none arrived within ``timeout``."""
        ...

    def release(self) -> None:
        """The round is over (or failed): nothing may wait for a start any more."""

    def stop(self) -> list[str]:
        """Ends every worker (bounded); returns the ones that had to be forced."""
        ...


RAY_MISSING = (
    "--launcher ray needs Ray, which is not installed for {python}: "
    "pip install 'id-echo[distributed]' (or pip install ray)"
)
RAY_NUM_CPUS = 4  # the most CPUs the local Ray instance schedules with
RAY_OBJECT_STORE_BYTES = 128 * 1024 * 1024  # Ray's default takes 30% of the memory


def import_ray() -> Any:
    """The ``ray`` module; RuntimeError with the install hint where it is not installed."""
    try:
        return importlib.import_module("ray")
    except ImportError as e:
        raise RuntimeError(RAY_MISSING.format(python=sys.executable)) from e


def ray_start(ray: Any) -> None:
    """A local Ray instance for the actors: no dashboard, a bounded CPU count and object
    store. The actors are ordinary Ray workers, so they get this process's environment:
    ``PYTHONPATH`` gains the directory that this process imports echo from and the repository
    root (for ``benches``), so the actors import the same echo and this module (each checks
    ``echo.__file__`` against ours anyway)."""
    paths = [str(Path(learner_echo_file()).parent.parent), str(h.ROOT)]
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *([old] if old else [])])
    ray.init(
        address="local",  # a Ray of its own, not a cluster another process started
        num_cpus=max(1, min(RAY_NUM_CPUS, os.cpu_count() or 1)),
        include_dashboard=False,
        object_store_memory=RAY_OBJECT_STORE_BYTES,
        configure_logging=False,
    )


class RayWorkers:
    """K Ray actors in the running Ray instance; the start signal is the ``run(t0)`` call."""

    def __init__(self, ray: Any, args: list[WorkerArgs]) -> None:
        self._ray = ray
        self._args = args
        # num_cpus=0: an actor holds no CPU slot, so K is not capped by the CPU count.
        self._cls = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(_RayWorker)
        self._actors: list[Any] = []
        self._ready: dict[Any, int] = {}  # pending ready() refs -> worker id
        self._running: dict[Any, int] = {}  # pending run() refs -> worker id
        self._lock = threading.Lock()  # the collector thread polls while the learner stops

    def start(self) -> None:
        self._actors = [self._cls.remote(a) for a in self._args]
        pairs = zip(self._actors, self._args, strict=True)
        self._ready = {actor.ready.remote(): a.wid for actor, a in pairs}

    def poll_ready(self, timeout: float) -> list[bool]:
        pending = list(self._ready)
        if not pending:
            return []
        done, _ = self._ray.wait(pending, num_returns=len(pending), timeout=timeout)
        out: list[bool] = []
        for ref in done:
            del self._ready[ref]
            try:
                out.append(bool(self._ray.get(ref, timeout=10.0)))
            except self._ray.exceptions.RayError:  # the actor died while connecting
                out.append(False)
        return out

    def go(self, t0: float) -> None:
        pairs = zip(self._actors, self._args, strict=True)
        with self._lock:
            self._running = {actor.run.remote(t0): a.wid for actor, a in pairs}

    def release(self) -> None:
        """Nothing to do: an actor that was never told to run is killed in ``stop()``."""

    def poll_result(self, timeout: float) -> dict[str, Any] | None:
        with self._lock:
            pending = list(self._running)
        if not pending:  # not started yet, or every report is in
            time.sleep(timeout)
            return None
        done, _ = self._ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:
            return None
        with self._lock:
            wid = self._running.pop(done[0])
        try:
            r: dict[str, Any] = self._ray.get(done[0], timeout=10.0)
        except self._ray.exceptions.RayError as e:  # the actor died
            r = {"wid": wid, "sent": 0, "error": f"actor: {err_text(e)}"}
        return r

    def stop(self) -> list[str]:
        """Waits 10 s for the actors still running, then kills every actor of the round;
        returns those that were stuck."""
        with self._lock:
            running = dict(self._running)
        stuck: list[str] = []
        if running:
            _, left = self._ray.wait(list(running), num_returns=len(running), timeout=10.0)
            stuck = [f"actor {running[ref]}" for ref in left]
        for actor in self._actors:
            self._ray.kill(actor, no_restart=True)
        self._actors = []
        return stuck


# --------------------------------------------------------------------------- loopback reference


def _loopback_receiver(port_q: Any, result_q: Any) -> None:
    worker_watchdog(60.0, "loopback receiver")
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind((HOST, 0))
    srv.listen(1)
    srv.settimeout(30.0)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.settimeout(30.0)
    buf = bytearray(1 << 20)
    total = 0
    t_first = t_last = time.monotonic()
    n = conn.recv_into(buf)
    t_first = time.monotonic()
    while n:
        total += n
        n = conn.recv_into(buf)
    t_last = time.monotonic()
    conn.close()
    srv.close()
    result_q.put({"bytes": total, "seconds": t_last - t_first})


def _loopback_once(ctx: Any, seconds: float, chunk_bytes: int) -> dict[str, Any]:
    port_q, result_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_loopback_receiver, args=(port_q, result_q), daemon=True)
    proc.start()
    try:
        port = port_q.get(timeout=30.0)
        chunk = memoryview(bytes(chunk_bytes))
        sent = 0
        with socket.create_connection((HOST, port), timeout=30.0) as sock:
            t0 = time.monotonic()
            deadline = t0 + seconds
            for _ in range(100_000_000):
                sock.sendall(chunk)
                sent += chunk_bytes
                if time.monotonic() >= deadline:
                    break
            send_s = time.monotonic() - t0
        got = result_q.get(timeout=30.0)
    finally:
        proc.join(timeout=10.0)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5.0)
    return {
        "bytes": got["bytes"],
        "complete": got["bytes"] == sent,
        "seconds": got["seconds"],
        "gbps": got["bytes"] / got["seconds"] / 1e9,
        "sender_gbps": sent / send_s / 1e9,
    }


def bench_loopback(ctx: Any, seconds: float, chunk_bytes: int, reps: int = 3) -> dict[str, Any]:
    """Plain-socket bandwidth between two processes over 127.0.0.1 (``sendall`` of chunks).

    ``reps`` transfers of ``seconds / reps`` each; the best one is the reference (a shared
    machine's transient load only ever lowers it).
    """
    runs = [_loopback_once(ctx, seconds / reps, chunk_bytes) for _ in range(reps)]
    best = max(runs, key=lambda r: float(r["gbps"]))
    return {"chunk_bytes": chunk_bytes, **best, "runs_gbps": [r["gbps"] for r in runs]}


def best_loopback(before: dict[str, Any], after: dict[str, Any] | None) -> dict[str, Any]:
    """The faster of two loopback measurements, before and after the rounds (a busy moment
    only ever lowers it), with both numbers; ``after`` None: ``before`` alone."""
    if after is None:
        return dict(before, before_gbps=before["gbps"], after_gbps=None)
    loop = dict(max(before, after, key=lambda d: float(d["gbps"])))
    loop["before_gbps"], loop["after_gbps"] = before["gbps"], after["gbps"]
    loop["runs_gbps"] = list(before["runs_gbps"]) + list(after["runs_gbps"])
    return loop
