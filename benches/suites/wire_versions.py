"""Wire versions: samples/s of wire protocol v2 against v1, from the same echo client to the
same echo server, so the cost of v2's per-sample framing (a frame byte, implicit sequence
numbers, the resend buffer of a session) shows as a ratio.

For each scenario, each K (worker processes) and each repeat, this process starts a learner,
``Server(example, batch_size, transport=TcpTransport(port=0, host="127.0.0.1"))``, and K
worker processes (this interpreter running this file with ``--worker``). Then, on that one
server, two phases, ``protocol=1`` and ``protocol=2``, in alternating order from repeat to
repeat (1 2, 2 1, 1 2, ...):

1. every worker connects a ``TcpClient(..., protocol=P, max_inflight_msgs=32)`` and says
   ``ready``; once all have, the learner sends ``go T`` (``T`` a moment ahead on
   ``time.monotonic()``, one clock for every process on Linux), and every worker sends from
   ``T`` until ``T + warmup + seconds``, then ``wait()``s for its acks, ``close()``s and reports
   how many it sent and its CPU time (``getrusage``) over the sending;
2. the learner calls ``sample()`` all along and reads every batch: each sample's ``meta``
   leaf ``(worker, seq, phase)`` and element 0 of every ``float32`` leaf, which holds
   ``seq % 2**24`` (a torn or misaligned sample shows). Samples whose ``sample()`` returned
   inside ``[T + warmup, T + warmup + seconds]`` count for samples/s; the learner's CPU
   time over that window is recorded too;
3. once every worker has reported, the learner ``submit()``s marker samples (worker -1) to
   complete the last batch and reads until it has seen every sample sent. ``correct``:
   every sample arrived exactly once, intact, in per-worker order, and no worker failed.

Scenarios:

* ``small``: a nested dict of 21 leaves, 309 bytes: ``{"obs": {"o00".."o15": f32[4]},
  "act": {"a": i64[], "b": i64[2]}, "rew": f32[], "done": bool[], "meta": f64[3]}`` (one
  ``f32`` scalar ``rew`` and 16 ``f32[4]``), batch_size 32;
* ``large``: 40 leaves ``f32[1280]`` and ``meta``, 204,824 bytes, batch_size 64.

The table shows, per scenario and K, the median samples/s of each protocol over the repeats,
the median of the per-repeat ratios v2/v1 (and their range), and the workers' CPU per sample
sent (µs), which another process's load moves much less than throughput. Every loop is
bounded in count and time: workers stop at their deadline and have a watchdog; the learner
closes its server when a phase overruns; a watchdog ends the whole run after
``--max-seconds``; the driver kills (by PID) only the workers it started. Loopback only.

Run: ``python -m benches wire-versions [--quick] [--set workers=[1,4,16]]``.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from benches import common as c
from echo import Server, TcpClient, TcpTransport

ROOT = Path(__file__).resolve().parent.parent.parent
HOST = "127.0.0.1"
ID_MOD = 2**24
WINDOW = 32
MARKER = -1.0
SCENARIOS = {"small": 32, "large": 64}  # name -> batch_size
PROTOCOLS = (1, 2)
READY_TIMEOUT_S = 60.0  # interpreter start-up of 16 workers on a busy 2-core machine
START_AHEAD_S = 0.2
STALL_S = 5.0

log = c.logger("wire-versions")


def example(name: str) -> dict[str, Any]:
    if name == "small":
        return {
            "obs": {f"o{i:02d}": np.zeros(4, np.float32) for i in range(16)},
            "act": {"a": np.zeros((), np.int64), "b": np.zeros(2, np.int64)},
            "rew": np.zeros((), np.float32),
            "done": np.zeros((), np.bool_),
            "meta": np.zeros(3, np.float64),
        }
    tree: dict[str, Any] = {f"x{i:02d}": np.zeros(1280, np.float32) for i in range(40)}
    tree["meta"] = np.zeros(3, np.float64)
    return tree


def f32_leaves(tree: Any) -> list[np.ndarray]:
    """The float32 leaves of a (nested dict) tree, in a fixed order."""
    out: list[np.ndarray] = []
    for key in sorted(tree):
        value = tree[key]
        if isinstance(value, dict):
            out += f32_leaves(value)
        elif value.dtype == np.float32:
            out.append(value)
    return out


def sample_bytes(tree: Any) -> int:
    return sum(sample_bytes(v) if isinstance(v, dict) else int(v.nbytes) for v in tree.values())


def count_leaves(tree: Any) -> int:
    return sum(count_leaves(v) if isinstance(v, dict) else 1 for v in tree.values())


# --------------------------------------------------------------------------- worker


def _connect(port: int, tree: Any, protocol: int) -> TcpClient:
    """A TCP connection with wire ``protocol``: never the shared-memory path, which v2 takes on
    the same host by default (an echo without that path has no ``shared_memory`` argument)."""
    try:
        return TcpClient(
            HOST, port, tree, max_inflight_msgs=WINDOW, protocol=protocol, shared_memory=False
        )
    except TypeError:
        return TcpClient(HOST, port, tree, max_inflight_msgs=WINDOW, protocol=protocol)


def worker_main(argv: list[str]) -> int:
    """``--worker PORT SCENARIO WID PHASES...``: one connection per phase; commands on stdin."""
    port, scenario, wid = int(argv[0]), argv[1], int(argv[2])
    phases = [int(p) for p in argv[3:]]
    c.start_watchdog(600.0, f"wire-versions worker {wid}")

    def say(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    tree = example(scenario)
    heads = f32_leaves(tree)
    meta = tree["meta"]
    meta[0] = wid
    for phase, protocol in enumerate(phases):
        report: dict[str, Any] = {"wid": wid, "phase": phase, "sent": 0, "error": None}
        try:
            client = _connect(port, tree, protocol)
        except Exception as e:  # noqa: BLE001 - reported to the learner
            report["error"] = f"connect: {type(e).__name__}: {e}"
            say("ready")
            say("result " + json.dumps(report))
            continue
        report["protocol"] = client.protocol
        say("ready")
        line = sys.stdin.readline().split()
        if line[:1] != ["go"]:
            client.close(timeout=1.0)
            return 1
        start, end = float(line[1]), float(line[2])
        time.sleep(max(0.0, start - time.monotonic()))
        meta[2] = phase
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        seq = 0
        try:
            for _ in range(10**9):
                if time.monotonic() >= end:
                    break
                meta[1] = seq
                for head in heads:
                    head.flat[0] = seq % ID_MOD
                client.send(tree, timeout=30.0)
                seq += 1
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            client.wait(timeout=60.0)
            report["flushed"] = client.close(timeout=30.0)
        except Exception as e:  # noqa: BLE001 - reported to the learner
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            report["error"] = f"{type(e).__name__}: {e}"
            client.close(timeout=1.0)
        report["sent"] = seq
        report["cpu_s"] = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        say("result " + json.dumps(report))
    return 0


# --------------------------------------------------------------------------- learner


#: How a worker process is started.
MODULE = [sys.executable, "-m", "benches.suites.wire_versions"]


def workers_of(port: int, scenario: str, k: int, phases: list[int]) -> c.LineWorkers:
    """K worker processes of `scenario` sending to `port` in `phases`."""
    cmds = [
        [*MODULE, "--worker", str(port), scenario, str(wid), *(str(p) for p in phases)]
        for wid in range(k)
    ]
    return c.LineWorkers(cmds, ROOT)


class Reader:
    """Reads every batch the server hands out: counts, checks, timestamps."""

    def __init__(self, server: Server, tree: Any) -> None:
        self.server = server
        self.f32_paths = self._f32_paths(tree)
        self.errors: list[str] = []
        self.seen: dict[tuple[int, int], int] = {}  # (phase, worker) -> next seq
        self.received = 0
        self.markers = 0
        self.in_window = 0

    @staticmethod
    def _f32_paths(tree: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
        out: list[tuple[str, ...]] = []
        for key in sorted(tree):
            value = tree[key]
            if isinstance(value, dict):
                out += Reader._f32_paths(value, (*prefix, key))
            elif value.dtype == np.float32:
                out.append((*prefix, key))
        return out

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
        heads = []
        for path in self.f32_paths:
            leaf = batch
            for key in path:
                leaf = leaf[key]
            heads.append(np.asarray(leaf).reshape(len(meta), -1)[:, 0])
        for row, (wid_f, seq_f, phase_f) in enumerate(meta):
            if wid_f == MARKER:
                self.markers += 1
                continue
            wid, seq, phase = int(wid_f), int(seq_f), int(phase_f)
            want = self.seen.get((phase, wid), 0)
            if seq != want and len(self.errors) < 10:
                self.errors.append(f"phase {phase} worker {wid}: seq {seq}, expected {want}")
            self.seen[(phase, wid)] = seq + 1
            for head in heads:
                if head[row] != seq % ID_MOD and len(self.errors) < 10:
                    self.errors.append(f"phase {phase} worker {wid} seq {seq}: torn sample")
                    break
            self.received += 1
            if window[0] <= now <= window[1]:
                self.in_window += 1
        return True


def run_phase(
    server: Server,
    workers: c.LineWorkers,
    reader: Reader,
    tree: Any,
    protocol: int,
    args: Any,
) -> dict[str, Any]:
    workers.expect("ready", READY_TIMEOUT_S)
    start = time.monotonic() + START_AHEAD_S
    window = (start + args.warmup, start + args.warmup + args.seconds)
    workers.tell(f"go {start!r} {window[1]!r}")
    cpu0 = cpu1 = None
    deadline = window[1] + 120.0
    results: list[dict[str, Any]] | None = None
    for _ in range(10**9):
        now = time.monotonic()
        if cpu0 is None and now >= window[0]:
            cpu0 = time.process_time()
        if cpu1 is None and now >= window[1]:
            cpu1 = time.process_time()
        if now > deadline:
            reader.errors.append("phase overran: closing")
            break
        reader.read_one(0.05, window)
        if now >= window[1]:
            try:
                results = [json.loads(x.split(" ", 1)[1]) for x in workers.expect("result", 0)]
            except TimeoutError:
                continue
            break
    if cpu0 is None:
        cpu0 = time.process_time()
    if cpu1 is None:
        cpu1 = time.process_time()
    results = results or []
    sent = sum(r["sent"] for r in results)
    # Every earlier phase ended on a batch boundary: complete this phase's last batch with
    # markers (from a thread: the ring may be full until this one reads), then read until
    # everything sent has arrived.
    pad = (-sent) % server.batch_size
    marker = _with_meta(tree, np.array([MARKER, 0, 0], np.float64))
    padder = threading.Thread(
        target=lambda: [server.submit(marker, timeout=30.0) for _ in range(pad)], daemon=True
    )
    padder.start()
    stalled_since = time.monotonic()
    while reader.received < sent or reader.markers < pad:
        if reader.read_one(0.2, (0.0, -1.0)):
            stalled_since = time.monotonic()
        elif time.monotonic() - stalled_since > STALL_S:
            reader.errors.append(f"stalled: {reader.received} of {sent} samples arrived")
            break
    padder.join(timeout=STALL_S)
    errors = [r["error"] for r in results if r.get("error")]
    protocols = sorted({r.get("protocol") for r in results})
    return {
        "protocol": protocol,
        "negotiated": protocols,
        "samples_per_s": c.rate(reader.in_window, args.seconds),
        "in_window": reader.in_window,
        "sent": sent,
        "learner_cpu_us_per_sample": 1e6 * (cpu1 - cpu0) / max(reader.in_window, 1),
        "worker_cpu_us_per_sample": 1e6 * sum(r.get("cpu_s", 0.0) for r in results) / max(sent, 1),
        "worker_errors": errors,
        "correct": not errors
        and not reader.errors
        and protocols == [protocol]
        and all(r.get("flushed") for r in results),
        "errors": list(reader.errors),
    }


def _with_meta(tree: Any, meta: np.ndarray) -> Any:
    out = {k: (_with_meta(v, meta) if isinstance(v, dict) else v) for k, v in tree.items()}
    if "meta" in out:
        out["meta"] = meta
    return out


def run_round(scenario: str, k: int, order: list[int], args: Any) -> list[dict[str, Any]]:
    tree = example(scenario)
    batch_size = SCENARIOS[scenario]
    server = Server(tree, batch_size, transport=TcpTransport(port=0, host=HOST))
    server.start()
    guard = c.call_later(args.seconds * 2 * len(order) + 300.0, server.close)
    assert server.port is not None
    workers = workers_of(server.port, scenario, k, order)
    out = []
    try:
        for protocol in order:
            reader = Reader(server, tree)
            res = run_phase(server, workers, reader, tree, protocol, args)
            res.update(scenario=scenario, k=k, order=order)
            log(
                f"{scenario} K={k} v{protocol}: {res['samples_per_s']:,.0f} samples/s "
                f"correct={res['correct']} {res['errors'][:1]}{res['worker_errors'][:1]}"
            )
            out.append(res)
    finally:
        guard.cancel()
        workers.stop()
        server.close()
    return out


def parameters(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "scenarios": list(SCENARIOS),
            "workers": [1, 4],
            "repeats": 1,
            "seconds": 1.0,
            "warmup": 0.5,
        }
    return {
        "scenarios": list(SCENARIOS),
        "workers": [1, 4, 16],
        "repeats": 3,
        "seconds": 2.0,
        "warmup": 0.5,
    }


def limit_s(params: dict[str, Any]) -> float:
    phases = len(params["scenarios"]) * len(params["workers"]) * int(params["repeats"]) * 2
    return phases * (float(params["seconds"]) + float(params["warmup"]) + 30.0) + 60.0


def measure(params: dict[str, Any]) -> dict[str, Any]:
    args = SimpleNamespace(seconds=float(params["seconds"]), warmup=float(params["warmup"]))
    rounds: list[dict[str, Any]] = []
    for rep in range(int(params["repeats"])):
        order = list(PROTOCOLS) if rep % 2 == 0 else list(reversed(PROTOCOLS))
        for scenario in params["scenarios"]:
            for k in params["workers"]:
                for res in run_round(scenario, int(k), order, args):
                    rounds.append({"repeat": rep, **{key: res[key] for key in ROUND_KEYS}})
    summary = []
    for scenario in params["scenarios"]:
        tree = example(scenario)
        for k in params["workers"]:
            cell = [r for r in rounds if r["scenario"] == scenario and r["k"] == k]
            by = {p: [r for r in cell if r["protocol"] == p] for p in PROTOCOLS}
            ratios = []
            for rep in range(int(params["repeats"])):
                pair = {r["protocol"]: r for r in cell if r["repeat"] == rep}
                if set(pair) == set(PROTOCOLS) and pair[1]["samples_per_s"] > 0:
                    ratios.append(pair[2]["samples_per_s"] / pair[1]["samples_per_s"])
            med = {p: statistics.median(r["samples_per_s"] for r in by[p]) for p in PROTOCOLS}
            cpu = {
                p: statistics.median(r["worker_cpu_us_per_sample"] for r in by[p])
                for p in PROTOCOLS
            }
            summary.append(
                {
                    "scenario": scenario,
                    "bytes": sample_bytes(tree),
                    "leaves": count_leaves(tree),
                    "k": k,
                    "v1_samples_per_s": med[1],
                    "v2_samples_per_s": med[2],
                    "ratio_v2_v1": statistics.median(ratios) if ratios else None,
                    "ratios": ratios,
                    "v1_worker_cpu_us": cpu[1],
                    "v2_worker_cpu_us": cpu[2],
                    "correct": all(r["correct"] for r in cell),
                }
            )
    return {"summary": summary, "correct": all(s["correct"] for s in summary)}


ROUND_KEYS = ("scenario", "k", "protocol", "samples_per_s", "worker_cpu_us_per_sample", "correct")


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    columns = [
        "echo",
        "scenario",
        "bytes",
        "leaves",
        "K",
        "v1 samples/s",
        "v2 samples/s",
        "v2 / v1",
        "range",
        "v1 worker us/sample",
        "v2 worker us/sample",
        "correct",
    ]
    rows = c.failed_rows(results, len(columns))
    for side, r in results.items():
        for s in r.get("summary", []):
            ratios = s["ratios"]
            rows.append(
                [
                    side,
                    s["scenario"],
                    f"{s['bytes']:,}",
                    str(s["leaves"]),
                    str(s["k"]),
                    c.num(s["v1_samples_per_s"]),
                    c.num(s["v2_samples_per_s"]),
                    c.num(s["ratio_v2_v1"], ".3f"),
                    c.span(ratios, ".3f"),
                    c.num(s["v1_worker_cpu_us"], ".1f"),
                    c.num(s["v2_worker_cpu_us"], ".1f"),
                    "yes" if s["correct"] else "NO",
                ]
            )
    return [
        {
            "title": f"Wire v2 against v1: K worker processes, {params['repeats']} repeat(s) of "
            f"{params['seconds']:g} s each (medians)",
            "columns": columns,
            "rows": rows,
            "notes": [
                "*range*: the per-repeat ratios. *worker us/sample*: the workers' CPU per sample "
                "sent, which another process's load moves much less than samples/s."
            ],
        }
    ]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2:]))
