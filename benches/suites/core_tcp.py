"""End-to-end TCP benchmark (learner + K workers) for any installed ``echo``.

The learner runs in this process: ``Server(example, batch_size, transport=TcpTransport(...))``,
``start()``, then ``sample()`` in a loop. By default K worker processes (``multiprocessing``
with the ``forkserver`` context, the same interpreter and ``sys.path``, so they import the
same ``echo``; each checks ``echo.__file__`` against the learner's) each connect a ``TcpClient``
to ``127.0.0.1``, report ready, wait for a common start signal (so no worker is still
starting while others are timed), send samples in a loop until a common deadline, then
``wait()`` for every ack (0.2.1's ``close()`` does not flush) and ``close()``. Only the API
that both our ``echo`` and the published ``id-echo`` 0.2.1 provide is used:
``TcpTransport(port)`` (``host="127.0.0.1"`` where accepted: 0.2.1 has no ``host`` and always
binds every interface), ``Server.start()``/``port``/``sample()``/``submit()``/``close()``,
``TcpClient(host, port, example, max_inflight_msgs=32)``, ``send()``/``wait()``/``close()``.

``--launcher ray`` launches the workers as Ray actors instead, running the same code: an actor
connects when it is created and says so through ``ready()``; ``run(t0)`` is the start signal
and returns the report, collected with ``ray.wait``/``ray.get`` under timeouts.
``ray.init()`` starts a local Ray instance (no dashboard, at most 4 CPUs, a 128 MiB object
store) after the loopback reference and ``ray.shutdown()`` ends it after the rounds; each
round's actors are killed at its end. Ray is optional (the ``distributed`` extra,
``pip install 'id-echo[distributed]'``); without it ``--launcher ray`` exits with status 2
and says so. The actors connect to 127.0.0.1 like the processes, so this is a single-machine
run.

Scenarios (pytree, batch size); every sample carries a ``meta`` leaf
``f64[3] = (worker id, sequence number, send time)`` (send time: ``time.monotonic()``,
``CLOCK_MONOTONIC``, one clock for every process on Linux), and element 0 of every other leaf
holds ``seq % 2**24`` so a misaligned or torn sample is caught:

* ``small``: ``{"obs": f32[4], "reward": f32[1], "meta": f64[3]}``, 44 B, batch_size 32.
* ``large``: 40 leaves ``f32[1280]`` + ``meta`` (204,824 B per sample), batch_size 64.
* ``nest-tcp`` / ``nest-shm``: a large nested sample, 40 leaves ``f32[1224]`` in 4 nested dicts
  of 10 + ``meta`` (195,864 B), batch_size 64; ``nest-tcp`` over TCP, ``nest-shm`` over the
  same-host shared-memory path (``shared_memory=True``; skipped for an echo without it).

Our clients pass ``shared_memory=False`` in every scenario but ``nest-shm`` (where the
installed echo takes the argument), so the TCP rows measure TCP.

For each K (default 1, 4, 16, 64) the learner reports, over the timed window (``--seconds``
after a ``--warmup`` of 0.5 s that is excluded):

* samples/s and payload GB/s (1e9 B/s) received by the learner (``sample()`` returned
  inside the window);
* per-sample latency p50 / p99 in ms: ``time.monotonic()`` when ``sample()`` returned minus
  the send time, for samples sent inside the window (samples in the final, marker-padded
  batch excluded). It includes the wait for the batch to fill;
* ``correct``: every sent sample arrived exactly once, with an intact payload, per-worker
  order preserved (``in_order``, FIFO), no worker error, nothing stuck;
* CPU: the learner process's CPU seconds over the window (all its threads, as cores), and
  the workers' CPU microseconds per sample sent.

The run's total is only known when every worker has reported how many samples it sent; the
learner then ``submit()``s 1..batch_size marker samples (worker id -1) so that the last
batch completes, and stops once it has seen everything. A lost sample therefore shows up as
``correct: false`` (``stalled``: after 3 s without a batch the learner adds markers one by
one until the last batch completes, so ``missing`` counts only samples that never arrived,
then closes the server, which wakes ``sample()``). Workers ``wait()`` for their acks and
then ``close()`` at once, as a user would; id-echo 0.2.1 sometimes drops acknowledged samples
of a connection that closes right after its last ack (``missing > 0`` there; ours must not).

Reference: raw loopback TCP bandwidth, one process ``sendall``-ing 64 KiB chunks to another
that ``recv_into``s them, ~2 s in three transfers before the rounds and again after them, the
best transfer counting; the large scenario's GB/s is also reported as a fraction of it
(``frac_loopback``). This single-stream Python blast is the requested reference, not a hard
ceiling: its cost is per syscall, so echo's larger writes (one ~200 KB vectored write per
large sample) and K parallel connections can exceed it (``frac_loopback > 1``). A second
reference with 1 MiB chunks (half the time) gives ``frac_loopback_1mib``.
``--loopback-seconds 0`` skips both (``python -m benches`` measures them once per session).

Every loop is bounded in count and time: workers send at most ``--count`` samples and stop at
the deadline; each worker has a watchdog (``os._exit``) and the learner closes the server if
a round overruns by ``--grace`` seconds, joins its workers and terminates any left; a
watchdog ends the whole run after ``--max-seconds``. Only loopback traffic.

Compare two implementations (one run each, same machine)::

    .venv/bin/python -m benches.suites.core_tcp --label ours --json benches/results/tcp-ours.json
    /work/venvs/peer/bin/python -m benches.suites.core_tcp --label id-echo-0.2.1 \\
        --json benches/results/tcp-peer.json
    python -m benches.compare benches/results/tcp-ours.json benches/results/tcp-peer.json

``--quick`` runs K = 1, 4 with 1.5 s each; ``--only small|large``; ``--workers 1,8,100``
(up to 1000); ``--launcher process|ray``. On a small machine the workers share the cores with
the learner: the numbers are end-to-end for this box, not the learner's limit. Depends on
numpy, echo and the standard library only (Ray for ``--launcher ray``).

This module holds the learner, the round and the command line; the scenarios and what the
learner and workers share are in :mod:`benches.suites.core_tcp_scenarios`, the workers, their
launchers and the loopback reference in :mod:`benches.suites.core_tcp_workers`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import echo
from benches import common as h
from benches.suites.core_tcp_scenarios import (
    BLOCK_BATCHES,
    HOST,
    ID_MOD,
    LAUNCHERS,
    LOOPBACK_BULK_CHUNK,
    LOOPBACK_CHUNK,
    MARKER_WID,
    MAX_INFLIGHT,
    MAX_ROWS,
    MAX_WORKERS,
    SCENARIOS,
    STALL_S,
    Scenario,
    WorkerArgs,
    err_text,
    has_shared_memory,
    learner_echo_file,
    log,
    worker_watchdog,
)
from benches.suites.core_tcp_workers import (
    ProcessWorkers,
    RayWorkers,
    Workers,
    bench_loopback,
    best_loopback,
    import_ray,
    ray_start,
)
from echo import Server, TcpTransport

# --------------------------------------------------------------------------- learner


def _make_server(sc: Scenario) -> tuple[Server, int, str, str]:
    """A started Server on a free loopback port: (server, port, bind, how the port was chosen)."""

    def transport(port: int) -> tuple[Any, str]:
        try:
            return TcpTransport(port, host=HOST), HOST
        except TypeError:  # 0.2.1: no host argument, binds every interface
            return TcpTransport(port), "0.0.0.0 (no host argument)"

    tr, bind = transport(0)
    server = Server(sc.example(), batch_size=sc.batch_size, transport=tr)
    try:
        server.start()
        port = server.port
    except (OSError, RuntimeError, ValueError, OverflowError):
        port = None
    if port:
        return server, int(port), bind, "port=0"
    server.close()
    last: BaseException | None = None
    for _ in range(5):  # port=0 not supported: pick a free port, retry if it got taken
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            free = int(s.getsockname()[1])
        tr, bind = transport(free)
        server = Server(sc.example(), batch_size=sc.batch_size, transport=tr)
        try:
            server.start()
        except (OSError, RuntimeError) as e:
            last = e
            server.close()
            continue
        return server, free, bind, "free port found first"
    raise RuntimeError(f"could not start a server on a free port: {last}")


@dataclass
class _Collected:
    """Filled by the collector thread: the workers' reports and the padding it submitted."""

    results: dict[int, dict[str, Any]] = field(default_factory=lambda: {})
    target: int | None = None  # total samples the learner must see (sent + markers)
    markers: int = 0
    complete: bool = False  # every worker reported in time
    submit_error: str | None = None
    rows_seen: int = 0  # updated by the consumer after every batch
    consumer_done: bool = False
    stalled: bool = False  # the target was never reached: closed after STALL_S without progress


def _collect(
    server: Server,
    sc: Scenario,
    k: int,
    workers: Workers,
    deadline: float,
    out: _Collected,
) -> None:
    while len(out.results) < k:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        r = workers.poll_result(min(left, 1.0))
        if r is not None:
            out.results[int(r["wid"])] = r
    if len(out.results) < k:
        server.close()  # wakes the consumer; the round is incomplete
        return
    out.complete = True
    total = sum(int(r["sent"]) for r in out.results.values())
    bs = sc.batch_size
    pad = (-total) % bs or bs  # at least one, so a consumer blocked in sample() wakes
    out.target = total + pad
    tree = sc.example()
    heads = [sc.leaf(tree, key).reshape(-1) for key, _ in sc.leaves]

    def submit_marker() -> None:
        i = out.markers
        for head in heads:
            head[0] = float(i)
        tree["meta"][:] = (MARKER_WID, i, time.monotonic())
        server.submit(tree)
        out.markers += 1

    try:
        for _ in range(pad):
            submit_marker()
    except (OSError, RuntimeError, ValueError, TypeError) as e:  # e.g. closed by the guard
        out.submit_error = err_text(e)
    # A sample that never arrives leaves the last batch incomplete and the consumer blocked.
    # After STALL_S without a batch: add markers one at a time until that batch completes (so
    # everything that did arrive is delivered and `missing` counts only real losses), then
    # close the server, which wakes the consumer.
    last, last_t = out.rows_seen, time.monotonic()
    while not out.consumer_done and time.monotonic() < deadline + STALL_S:
        time.sleep(0.05)
        if out.rows_seen != last:
            last, last_t = out.rows_seen, time.monotonic()
        elif time.monotonic() - last_t > STALL_S:
            out.stalled = True
            try:
                for _ in range(bs):
                    submit_marker()
                    t = time.monotonic()
                    while out.rows_seen == last and time.monotonic() - t < 0.2:
                        time.sleep(0.01)
                    if out.rows_seen != last:
                        break
                t = time.monotonic()
                while out.rows_seen == last and time.monotonic() - t < 1.0:
                    time.sleep(0.01)
            except (OSError, RuntimeError, ValueError, TypeError) as e:
                out.submit_error = err_text(e)
            server.close()
            break


def _verify(rows: np.ndarray, sent: list[int], markers: int, bs: int) -> dict[str, Any]:
    """Exactly-once and per-worker order of the received (wid, seq) rows."""
    wid = rows[:, 0]
    is_marker = wid == MARKER_WID
    w = wid[~is_marker].astype(np.int64)
    s = rows[~is_marker, 1].astype(np.int64)
    total = int(sum(sent))
    k = len(sent)
    counts = np.asarray(sent, np.int64)
    in_range = (w >= 0) & (w < k)
    in_range[in_range] &= (s[in_range] >= 0) & (s[in_range] < counts[w[in_range]])
    offsets = np.concatenate(([0], np.cumsum(counts)))
    flat = offsets[w[in_range]] + s[in_range]
    seen = np.bincount(flat, minlength=total) if total else np.zeros(0, np.int64)
    duplicates = int((seen[seen > 1] - 1).sum())
    missing = int((seen == 0).sum())
    order = np.argsort(w, kind="stable")
    ws, ss = w[order], s[order]
    same = ws[1:] == ws[:-1]
    out_of_order = int((np.diff(ss)[same] <= 0).sum())
    return {
        "received_real": int(w.size),
        "received_markers": int(is_marker.sum()),
        "markers_expected": markers,
        "bad_ids": int((~in_range).sum()),
        "duplicates": duplicates,
        "missing": missing,
        "out_of_order": out_of_order,
        "exactly_once": bool(
            w.size == total and not (~in_range).any() and duplicates == 0 and missing == 0
        ),
        "in_order": out_of_order == 0,
        "batches_with_markers": int(is_marker.reshape(-1, bs).any(axis=1).sum()) if bs else 0,
    }


def setup_timeout_s(launcher: str, k: int) -> float:
    """How long K workers may take to start and connect. A Ray actor is a fresh Ray worker
    process, and Ray starts only a few of those at a time."""
    return 60.0 + 1.0 * k if launcher == "ray" else 30.0 + 0.25 * k


def run_round(
    sc: Scenario, k: int, opts: argparse.Namespace, ctx: Any, ray: Any = None
) -> dict[str, Any]:
    """One round: the learner here, K workers launched as processes or (``ray`` given) as
    Ray actors."""
    bs = sc.batch_size
    server, port, bind, port_how = _make_server(sc)
    setup_timeout = setup_timeout_s("ray" if ray is not None else "process", k)

    def worker_args(wid: int) -> WorkerArgs:
        return WorkerArgs(
            wid=wid,
            port=port,
            scenario=sc.name,
            max_count=opts.count,
            warmup_s=opts.warmup,
            seconds=opts.seconds,
            go_timeout_s=setup_timeout + 10.0,
            flush_timeout_s=opts.grace,
            echo_file=learner_echo_file(),
        )

    all_args = [worker_args(i) for i in range(k)]
    workers: Workers = ProcessWorkers(ctx, all_args) if ray is None else RayWorkers(ray, all_args)
    keys = [key for key, _ in sc.leaves]
    blocks: list[np.ndarray] = []
    block_rows = BLOCK_BATCHES * bs
    rows_used = 0
    closed_early = overflow = False
    payload_bad_batches = 0
    busy_ns = 0
    collected = _Collected()
    collector: threading.Thread | None = None
    guard: threading.Timer | None = None
    last_info: Any = None
    cpu_marks: dict[str, float] = {}
    ready = 0
    setup_s = t_done = win0 = win1 = 0.0
    t_setup = time.monotonic()
    try:
        workers.start()
        failed = 0
        deadline = t_setup + setup_timeout
        while ready + failed < k and time.monotonic() < deadline:
            for ok in workers.poll_ready(min(1.0, max(0.01, deadline - time.monotonic()))):
                ready += ok
                failed += not ok
        setup_s = time.monotonic() - t_setup
        log(f"{sc.name} K={k}: {ready} workers ready ({failed} failed) in {setup_s:.1f} s")

        t0 = time.monotonic() + 0.02
        win0, win1 = t0 + opts.warmup, t0 + opts.warmup + opts.seconds
        round_deadline = win1 + opts.grace
        collector = threading.Thread(
            target=_collect,
            args=(server, sc, k, workers, round_deadline, collected),
            name="bench-tcp-collector",
            daemon=True,
        )
        collector.start()
        guard = h.call_later(round_deadline + 5.0 - time.monotonic(), server.close)

        def mark_cpu() -> None:  # learner-process CPU over the timed window
            for name, at in (("start", win0), ("end", win1)):
                time.sleep(max(0.0, at - time.monotonic()))
                cpu_marks[name] = time.process_time()

        marker = threading.Thread(target=mark_cpu, name="bench-tcp-cpu", daemon=True)
        marker.start()
        workers.go(t0)

        clock = time.monotonic
        clock_ns = time.perf_counter_ns
        block = np.empty((0, 4))
        pos = 0
        for _ in range(MAX_ROWS // bs + 1):
            target = collected.target
            if target is not None and rows_used >= target:
                break
            smp = server.sample()
            now = clock()
            b0 = clock_ns()
            if smp is None:
                closed_early = True
                break
            batch = smp.batch
            meta = batch["meta"]
            if pos == block.shape[0]:
                if rows_used + block_rows > MAX_ROWS:
                    overflow = True
                    break
                block = np.empty((block_rows, 4))
                blocks.append(block)
                pos = 0
            dst = block[pos : pos + bs]
            dst[:, :3] = meta
            dst[:, 3] = now
            expect = (dst[:, 1] % ID_MOD).astype(np.float32)
            for key in keys:
                if not np.array_equal(sc.leaf(batch, key)[:, 0], expect):
                    payload_bad_batches += 1
                    break
            pos += bs
            rows_used += bs
            collected.rows_seen = rows_used
            last_info = smp.info
            smp = batch = meta = None
            busy_ns += clock_ns() - b0
        t_done = time.monotonic()
    finally:
        collected.consumer_done = True
        if guard is not None:
            guard.cancel()
        server.close()
        workers.release()
        if collector is not None:
            collector.join(timeout=opts.grace + 10.0)
        stuck = workers.stop()

    rows = np.concatenate(blocks)[:rows_used] if blocks else np.empty((0, 4))
    results = [
        collected.results.get(i, {"wid": i, "sent": 0, "error": "no report"}) for i in range(k)
    ]
    sent = [int(r["sent"]) for r in results]
    errors = [f"worker {r['wid']}: {r['error']}" for r in results if r.get("error")]
    ver = _verify(rows, sent, collected.markers, bs)
    is_marker_batch = np.repeat(rows[:, 0].reshape(-1, bs).min(axis=1) == MARKER_WID, bs)
    real = rows[:, 0] != MARKER_WID
    t_send, t_recv = rows[:, 2], rows[:, 3]
    in_win = real & (t_recv >= win0) & (t_recv < win1)
    n_win = int(in_win.sum())
    lat_sel = real & ~is_marker_batch & (t_send >= win0) & (t_send < win1)
    lat_ms = (t_recv[lat_sel] - t_send[lat_sel]) * 1e3

    def pct(q: float) -> float:
        return float(np.percentile(lat_ms, q)) if lat_ms.size else float("nan")

    cpu_learner = cpu_marks.get("end", np.nan) - cpu_marks.get("start", np.nan)
    worker_cpu = sum(float(r.get("cpu_s", 0.0)) for r in results)
    total_sent = int(sum(sent))
    gbps = n_win * sc.sample_bytes / opts.seconds / 1e9
    correct = bool(
        ver["exactly_once"]
        and ver["in_order"]
        and ver["received_markers"] == collected.markers
        and payload_bad_batches == 0
        and not errors
        and not closed_early
        and not overflow
        and collected.complete
        and collected.submit_error is None
        and not stuck
        and ready == k
    )
    info: dict[str, Any] = {}
    for attr in (
        "active_connections",
        "push_blocked_count",
        "samples_inserted_total",
        "queue_depth_max",
        "notify_count",
    ):
        info[attr] = getattr(last_info, attr, None)
    return {
        "workers": k,
        "batch_size": bs,
        "sample_bytes": sc.sample_bytes,
        "port": port,
        "bind": bind,
        "port_choice": port_how,
        "setup_s": setup_s,
        "workers_ready": ready,
        "window_s": opts.seconds,
        "warmup_s": opts.warmup,
        "samples_in_window": n_win,
        "samples_per_s": n_win / opts.seconds,
        "gbps": gbps,
        "frac_loopback": None,  # filled in once the loopback reference is final
        "latency_n": int(lat_ms.size),
        "p50_ms": pct(50),
        "p90_ms": pct(90),
        "p99_ms": pct(99),
        "max_ms": float(lat_ms.max()) if lat_ms.size else float("nan"),
        "sent_total": total_sent,
        "received_total": rows_used,
        "correct": correct,
        **ver,
        "payload_bad_batches": payload_bad_batches,
        "closed_early": closed_early,
        "overflow": overflow,
        "reports_complete": collected.complete,
        "submit_error": collected.submit_error,
        "stalled": collected.stalled,
        "worker_errors": errors[:20],
        "workers_stuck": len(stuck),
        "learner_cpu_cores": cpu_learner / opts.seconds,
        "learner_busy_s": busy_ns / 1e9,  # time outside sample(): recording + checks
        "worker_cpu_us_per_sample": worker_cpu / total_sent * 1e6 if total_sent else None,
        # fairness between connections: samples sent per worker
        "sent_per_worker_min": min(sent) if sent else 0,
        "sent_per_worker_max": max(sent) if sent else 0,
        "sent_per_worker": sent,
        "sent_per_worker_cv": float(np.std(sent) / np.mean(sent)) if total_sent else None,
        "worker_send_s_mean": float(np.mean([r.get("send_s", 0.0) for r in results])),
        "drain_s": t_done - win1,  # from the end of sending until the last batch
        "last_info": info,
    }


# --------------------------------------------------------------------------- driver


def _print_table(
    label: str, launcher: str, loop: dict[str, Any] | None, res: dict[str, Any]
) -> None:
    print(
        f"{h.run_title(label, echo)}; "
        f"workers as {'Ray actors' if launcher == 'ray' else 'processes'}"
    )
    if loop is not None:
        print(
            f"raw loopback TCP ({loop['chunk_bytes'] // 1024} KiB sendall): {loop['gbps']:.2f} GB/s"
            f" (before {loop['before_gbps']:.2f}, after {loop['after_gbps']:.2f}); with 1 MiB "
            f"sendall {loop['bulk_1mib']['gbps']:.2f} GB/s"
        )
    print(
        f"{'scenario':<8} {'K':>4} {'samples/s':>11} {'GB/s':>7} {'frac lo':>7} {'lo 1M':>6} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'correct':>7} {'order':>5} {'sent':>9} "
        f"{'setup s':>7} {'lrn cpu':>7} {'wkr us/s':>8}"
    )
    for name, rounds in res.items():
        for k, r in rounds.items():
            print(
                f"{name:<8} {k:>4} {r['samples_per_s']:>11,.0f} {r['gbps']:>7.3f} "
                f"{h.fmt_num(r['frac_loopback'], '.3f', 7)} "
                f"{h.fmt_num(r.get('frac_loopback_1mib'), '.3f', 6)} {r['p50_ms']:>8.2f} "
                f"{r['p99_ms']:>8.2f} {r['correct']!s:>7} {r['in_order']!s:>5} "
                f"{r['sent_total']:>9,} {r['setup_s']:>7.1f} {r['learner_cpu_cores']:>7.2f} "
                f"{h.fmt_num(r['worker_cpu_us_per_sample'], '.1f', 8)}"
            )
            if not r["correct"]:
                print(
                    f"  {name} K={k}: dup {r['duplicates']} missing {r['missing']} "
                    f"out_of_order {r['out_of_order']} bad_ids {r['bad_ids']} payload_bad "
                    f"{r['payload_bad_batches']} closed_early {r['closed_early']} stalled "
                    f"{r['stalled']} stuck "
                    f"{r['workers_stuck']} errors {r['worker_errors'][:3]}"
                )
    print(
        "  lrn cpu: learner process CPU (all threads) over the window, in cores; "
        "wkr us/s: worker CPU us per sample sent"
    )
    print(f"  load average (1/5/15 min) at the end: {os.getloadavg()}")


parse_workers = h.int_list("worker counts", MAX_WORKERS)


def main(argv: list[str] | None = None) -> int:
    p = h.bench_parser(__doc__, "K = 1, 4 only, 1.5 s each", max_seconds=600.0)
    p.add_argument("--only", choices=[s.name for s in SCENARIOS], action="append", default=None)
    p.add_argument(
        "--workers",
        type=parse_workers,
        default=None,
        help="comma-separated worker counts (default 1,4,16,64)",
    )
    p.add_argument("--seconds", type=float, default=None, help="timed window per round (4)")
    p.add_argument("--warmup", type=float, default=0.5, help="untimed sending first (s)")
    p.add_argument("--count", type=int, default=10_000_000, help="max samples per worker")
    p.add_argument("--grace", type=float, default=30.0, help="drain/flush limit per round (s)")
    p.add_argument(
        "--loopback-seconds",
        type=float,
        default=2.0,
        help="raw loopback reference before and after the rounds (s); 0 skips it",
    )
    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="process",
        help="workers as local processes (default) or as Ray actors in a local Ray instance "
        "(needs the distributed extra: pip install 'id-echo[distributed]')",
    )
    args = p.parse_args(argv)
    if args.seconds is None:
        args.seconds = 1.5 if args.quick else 4.0
    ks: list[int] = args.workers or ([1, 4] if args.quick else [1, 4, 16, 64])
    ray: Any = None
    if args.launcher == "ray":
        try:
            ray = import_ray()
        except RuntimeError as e:
            print(f"bench_tcp: {e}", file=sys.stderr)
            return 2

    worker_watchdog(args.max_seconds, "learner")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "echo"])
    load_before = h.loadavg()
    label = h.default_label(args.label, echo)
    log(
        f"{label}: echo {getattr(echo, '__version__', None)} from {learner_echo_file()}, "
        f"python {sys.executable}"
    )
    build = h.echo_build(echo)
    log(f"build: {build}")

    def loopback(when: str) -> tuple[dict[str, Any], dict[str, Any]]:
        std = bench_loopback(ctx, args.loopback_seconds, LOOPBACK_CHUNK)
        bulk = bench_loopback(ctx, args.loopback_seconds / 2, LOOPBACK_BULK_CHUNK)
        log(
            f"raw loopback ({when}): {std['gbps']:.2f} GB/s with 64 KiB sendall, "
            f"{bulk['gbps']:.2f} GB/s with 1 MiB"
        )
        return std, bulk

    with_loopback = args.loopback_seconds > 0  # 0: no reference (python -m benches has one)
    std0, bulk0 = loopback("before") if with_loopback else ({}, {})
    results: dict[str, dict[str, Any]] = {}
    if ray is not None:  # after the loopback reference: Ray's own processes take CPU
        t_ray = time.monotonic()
        ray_start(ray)
        log(f"ray {ray.__version__}: local instance up in {time.monotonic() - t_ray:.1f} s")
    try:
        for sc in SCENARIOS:
            if args.only and sc.name not in args.only:
                continue
            if sc.path == "shm" and not has_shared_memory():
                log(f"{sc.name}: skipped (this echo has no shared-memory path)")
                continue
            results[sc.name] = {}
            for k in ks:
                r = run_round(sc, k, args, ctx, ray)
                results[sc.name][str(k)] = r
                log(
                    f"{sc.name} K={k}: {r['samples_per_s']:,.0f} samples/s, "
                    f"{r['gbps']:.3f} GB/s, p50 {r['p50_ms']:.2f} ms, "
                    f"p99 {r['p99_ms']:.2f} ms, correct {r['correct']}"
                )
    finally:
        if ray is not None:
            ray.shutdown()

    loop: dict[str, Any] | None = None
    if with_loopback:
        std1, bulk1 = loopback("after")
        # The reference is the best transfer before or after the rounds: on a shared machine
        # a busy moment only ever lowers the measured bandwidth.
        loop = best_loopback(std0, std1)
        loop["bulk_1mib"] = best_loopback(bulk0, bulk1)
        bulk_gbps = float(loop["bulk_1mib"]["gbps"])
        for rounds in results.values():
            for r in rounds.values():
                r["frac_loopback"] = r["gbps"] / loop["gbps"] if loop["gbps"] else None
                r["frac_loopback_1mib"] = r["gbps"] / bulk_gbps if bulk_gbps else None
    _print_table(label, args.launcher, loop, results)
    if args.json is not None:
        doc = {
            **h.run_facts(label, echo),
            "echo_build": build,  # at the start; a rebuild during the run is flagged
            "echo_rebuilt_during_run": h.echo_build(echo) != build,
            "loadavg_before": load_before,
            "loadavg_after": h.loadavg(),
            "quick": args.quick,
            "workers": ks,
            "seconds": args.seconds,
            "warmup_s": args.warmup,
            "max_inflight_msgs": MAX_INFLIGHT,
            "launcher": args.launcher,
            "ray_version": getattr(ray, "__version__", None),
            "loopback": loop,
            "scenarios": results,
        }
        h.write_json(args.json, doc)
    ok = all(r["correct"] for rounds in results.values() for r in rounds.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
