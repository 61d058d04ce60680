"""Metrics: what serving Prometheus metrics (``echo.serve_metrics``) costs the learner.

Scrape cost. A learner process (this one) holds a TCP server, ``TcpTransport(0,
host="127.0.0.1")``, with ``connections`` connected ``TcpClient``\\ s opened by
``client_procs`` worker processes (each sends one sample, has it acknowledged and stays
connected; ``shared_memory=False``), a learner thread sampling, and ``serve_metrics`` on
loopback. Two numbers per connection count:

* *collect*: the CPU time (``time.thread_time``) of the calling thread for one
  ``generate_latest(registry)``: ``stats()`` plus formatting every series, no HTTP.
* *HTTP scrape*: a scraper process fetches ``/metrics`` ``scrapes`` times back to back; the
  learner process's CPU time (``time.process_time``: every thread, the transport's
  included) over those scrapes, minus what the process used while idle for as long, divided
  by the scrapes. Also the scraper's median wall time per scrape.

Checked: the scraped ``echo_connections_active`` equals the connections opened.

Throughput with a scraper. Small samples (``obs`` f32[4] + ``reward`` f32[1]), in-process
(``submit()`` of a batch then ``sample()``, batch 32) and over TCP (``bench_tcp``'s
``small`` scenario, K=1 worker process, every sample checked), each round once without
metrics and once with ``serve_metrics`` and a scraper process polling every
``poll_s`` seconds (started, and its first scrape done, before the round's clock starts),
alternating which goes first. Reported: the medians and the median of
the per-repeat ratios with/without. Loopback only; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from benches import common as c

# A scraper process: fetches URL COUNT times, PERIOD seconds apart (0: back to back), and
# prints each fetch's wall time; exits after COUNT fetches or when its parent ends it.
_SCRAPER = """
import sys, time, urllib.request
url, period, count = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
for _ in range(count):
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as r:
        body = r.read()
    dt = time.perf_counter() - t0
    print(f"{dt:.9f} {len(body)}", flush=True)
    if period:
        time.sleep(max(0.0, period - dt))
"""

# A worker process holding N connected clients: each sends one sample and waits for its ack;
# then "ready" on stdout, and the clients stay connected until stdin closes.
_CLIENTS = """
import sys
import numpy as np
import echo
port, n = int(sys.argv[1]), int(sys.argv[2])
example = {"obs": np.zeros(4, np.float32), "reward": np.zeros(1, np.float32)}
clients = [echo.TcpClient("127.0.0.1", port, example, shared_memory=False,
                          connect_timeout=30.0) for _ in range(n)]
for cl in clients:
    cl.send(example, timeout=30.0)
for cl in clients:
    cl.wait(timeout=30.0)
print("ready", flush=True)
sys.stdin.read()
for cl in clients:
    cl.close(timeout=5.0)
"""


def parameters(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "connections": [0, 1000],
            "client_procs": 4,
            "scrapes": 50,
            "collects": 200,
            "seconds": 2.0,
            "repeats": 3,
            "poll_s": 1.0,
        }
    return {
        "connections": [0, 100, 1000],
        "client_procs": 4,
        "scrapes": 200,
        "collects": 1000,
        "seconds": 5.0,
        "repeats": 5,
        "poll_s": 1.0,
    }


def limit_s(params: dict[str, Any]) -> float:
    per_count = 120.0 + 0.2 * int(params["scrapes"])
    per_repeat = 2 * 2 * (float(params["seconds"]) + 30.0)
    return len(params["connections"]) * per_count + int(params["repeats"]) * per_repeat + 60.0


def _example() -> dict[str, Any]:
    import numpy as np

    return {"obs": np.zeros(4, np.float32), "reward": np.zeros(1, np.float32)}


def _scraper(url: str, period: float, count: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _SCRAPER, url, str(period), str(count)],
        stdout=subprocess.PIPE,
        text=True,
    )


def _poller(url: str, period: float) -> subprocess.Popen[str]:
    """A scraper polling `url` every `period` seconds, returned once its first scrape is done
    (so that the interpreter's start-up is not inside the measured window)."""
    proc = _scraper(url, period, 100_000)
    assert proc.stdout is not None
    if not proc.stdout.readline().strip():
        _end(proc)
        raise RuntimeError("the scraper's first scrape failed")
    return proc


def _end(proc: subprocess.Popen[str]) -> None:
    """Ends a child this suite started (by its PID, through its Popen)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10.0)


def _scrape_cost(n_conn: int, params: dict[str, Any]) -> dict[str, Any]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    import echo

    server = echo.Server(
        _example(),
        batch_size=32,
        transport=echo.TcpTransport(0, host=c.HOST, max_connections=max(64, 2 * n_conn)),
        name="bench",
    )
    server.start()
    stop = threading.Event()

    def learn() -> None:
        for _ in range(10_000_000):
            if stop.is_set():
                return
            try:
                if server.sample(timeout=0.1) is None:
                    return
            except TimeoutError:
                continue

    learner = threading.Thread(target=learn, daemon=True)
    learner.start()
    procs: list[subprocess.Popen[str]] = []
    endpoint = echo.serve_metrics(server, port=0, host=c.HOST)
    try:
        nprocs = min(int(params["client_procs"]), n_conn)
        for i in range(nprocs):
            share = n_conn // nprocs + (1 if i < n_conn % nprocs else 0)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _CLIENTS, str(server.port), str(share)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"client process {p.pid} did not get ready: {line!r}")
        # The pure collect, in this thread.
        registry = endpoint.registry
        generate_latest(registry)
        collects = int(params["collects"])
        t0 = time.thread_time()
        for _ in range(collects):
            text = generate_latest(registry)
        collect_us = (time.thread_time() - t0) / collects * 1e6
        active = 0.0
        for fam in text_string_to_metric_families(text.decode()):
            for s in fam.samples:
                if s.name == "echo_connections_active":
                    active = s.value
        # Idle CPU of the whole process for about as long as the scrapes take.
        scrapes = int(params["scrapes"])
        warm = _scraper(endpoint.url, 0.0, 3)
        warm.communicate(timeout=60)
        cpu0, wall0 = time.process_time(), time.monotonic()
        scraper = _scraper(endpoint.url, 0.0, scrapes)
        out, _ = scraper.communicate(timeout=60 + 0.5 * scrapes)
        cpu_scrape, wall_scrape = time.process_time() - cpu0, time.monotonic() - wall0
        cpu1, wall1 = time.process_time(), time.monotonic()
        time.sleep(max(0.5, wall_scrape))
        cpu_idle, wall_idle = time.process_time() - cpu1, time.monotonic() - wall1
        walls = [float(line.split()[0]) for line in out.splitlines() if line.strip()]
        idle_share = cpu_idle / wall_idle * wall_scrape
        return {
            "connections": n_conn,
            "active_scraped": active,
            "collect_cpu_us": collect_us,
            "scrape_cpu_ms": (cpu_scrape - idle_share) / scrapes * 1e3,
            "scrape_cpu_raw_ms": cpu_scrape / scrapes * 1e3,
            "idle_cpu_per_s": cpu_idle / wall_idle,
            "scrape_wall_ms_p50": c.median(walls) * 1e3 if walls else None,
            "scrapes_done": len(walls),
            "body_bytes": len(text),
            "correct": active == n_conn and len(walls) == scrapes,
        }
    finally:
        for p in procs:
            if p.stdin is not None and p.poll() is None:
                p.stdin.close()
        for p in procs:
            try:
                p.wait(30.0)
            except subprocess.TimeoutExpired:
                _end(p)
        endpoint.close()
        stop.set()
        server.close()
        learner.join(10.0)


def _inprocess_round(seconds: float, with_metrics: bool, poll_s: float) -> float:
    import numpy as np

    import echo

    bs = 32
    server = echo.Server(_example(), batch_size=bs, name="bench")
    endpoint = scraper = None
    if with_metrics:
        endpoint = echo.serve_metrics(server, port=0, host=c.HOST)
        scraper = _poller(endpoint.url, poll_s)
    sample = {"obs": np.ones(4, np.float32), "reward": np.ones(1, np.float32)}
    try:
        n = 0
        t0 = time.perf_counter()
        deadline = t0 + seconds
        for _ in range(100_000_000):
            for _ in range(bs):
                server.submit(sample)
            got = server.sample(timeout=10.0)
            assert got is not None
            n += bs
            if time.perf_counter() >= deadline:
                break
        return n / (time.perf_counter() - t0)
    finally:
        if scraper is not None:
            _end(scraper)
        if endpoint is not None:
            endpoint.close()
        server.close()


def _tcp_round(seconds: float, with_metrics: bool, poll_s: float, ctx: Any) -> dict[str, Any]:
    import echo
    from benches.suites import core_tcp, core_tcp_scenarios

    opts = argparse.Namespace(count=10_000_000, warmup=0.5, seconds=seconds, grace=30.0)
    made: list[Any] = []
    original = core_tcp._make_server  # pyright: ignore[reportPrivateUsage]

    def make_with_metrics(sc: Any) -> Any:
        got = original(sc)
        endpoint = echo.serve_metrics(got[0], port=0, host=c.HOST)
        made.append((endpoint, _poller(endpoint.url, poll_s)))
        return got

    if with_metrics:
        core_tcp._make_server = make_with_metrics  # pyright: ignore[reportPrivateUsage]
    try:
        return core_tcp.run_round(core_tcp_scenarios.SCENARIO_BY_NAME["small"], 1, opts, ctx)
    finally:
        core_tcp._make_server = original  # pyright: ignore[reportPrivateUsage]
        for endpoint, scraper in made:
            _end(scraper)
            endpoint.close()


def measure(params: dict[str, Any]) -> dict[str, Any]:
    c.watchdog(limit_s(params))
    scrape = [_scrape_cost(int(n), params) for n in params["connections"]]
    seconds, poll_s = float(params["seconds"]), float(params["poll_s"])
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "echo"])
    rounds: list[dict[str, Any]] = []
    correct = all(r["correct"] for r in scrape)
    for rep in range(int(params["repeats"])):
        order = (False, True) if rep % 2 == 0 else (True, False)
        for on in order:
            rounds.append(
                {
                    "path": "in-process",
                    "repeat": rep,
                    "metrics": on,
                    "per_s": _inprocess_round(seconds, on, poll_s),
                }
            )
        for on in order:
            r = _tcp_round(seconds, on, poll_s, ctx)
            correct = correct and bool(r.get("correct"))
            rounds.append(
                {"path": "tcp", "repeat": rep, "metrics": on, "per_s": r["samples_per_s"]}
            )
    return {
        "scrape": scrape,
        "rounds": rounds,
        "cpus": os.cpu_count(),
        "loadavg": c.loadavg(),
        "correct": correct,
    }


def _throughput_rows(r: dict[str, Any], side: str) -> list[list[str]]:
    rows = []
    for path in ("in-process", "tcp"):
        mine = [x for x in r["rounds"] if x["path"] == path]
        off = {x["repeat"]: x["per_s"] for x in mine if not x["metrics"]}
        on = {x["repeat"]: x["per_s"] for x in mine if x["metrics"]}
        ratios = [on[k] / off[k] for k in off if k in on and off[k]]
        rows.append(
            [
                side,
                path,
                c.num(statistics.median(off.values()) if off else None),
                c.num(statistics.median(on.values()) if on else None),
                c.num(statistics.median(ratios) if ratios else None, ".3f"),
                f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else "-",
                str(len(ratios)),
            ]
        )
    return rows


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    scrape_cols = [
        "echo",
        "connections",
        "collect CPU (us)",
        "HTTP scrape, learner CPU (ms)",
        "scrape wall p50 (ms)",
        "exposition bytes",
        "active scraped",
    ]
    tp_cols = [
        "echo",
        "path",
        "samples/s, no metrics",
        f"samples/s, scraped every {params['poll_s']:g} s",
        "ratio (median)",
        "ratio range",
        "repeats",
    ]
    scrape_rows = c.failed_rows(results, len(scrape_cols))
    tp_rows = c.failed_rows(results, len(tp_cols))
    for side, r in results.items():
        if "error" in r:
            continue
        for s in r["scrape"]:
            scrape_rows.append(
                [
                    side,
                    f"{s['connections']:,}",
                    c.num(s["collect_cpu_us"]),
                    c.num(s["scrape_cpu_ms"], ".2f"),
                    c.num(s["scrape_wall_ms_p50"], ".2f"),
                    f"{s['body_bytes']:,}",
                    c.num(s["active_scraped"]),
                ]
            )
        tp_rows += _throughput_rows(r, side)
    return [
        {
            "title": "Scrape cost with connected TCP workers "
            f"({params['client_procs']} client processes, {params['scrapes']} scrapes)",
            "columns": scrape_cols,
            "rows": scrape_rows,
            "notes": [
                "*collect CPU*: one `generate_latest(registry)` in the calling thread "
                "(`stats()` and formatting), no HTTP.",
                "*HTTP scrape, learner CPU*: the learner process's CPU time (every thread) "
                "per scrape fetched back to back by another process, less the process's idle "
                "CPU for as long (the idle connections' heartbeats).",
            ],
        },
        {
            "title": "Small samples with and without a scraper",
            "columns": tp_cols,
            "rows": tp_rows,
            "notes": [
                "in-process: `submit()` x 32 then `sample()`; tcp: `bench_tcp` `small`, one "
                "worker process, every sample checked. Rounds alternate which goes first.",
            ],
        },
    ]
