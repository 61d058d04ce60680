"""The ``tcp`` part of the ``ragged`` suite (``benches/suites/ragged.py``), run by
``benches/suites/ragged_child.py``: rollouts sent by ``tcp_workers`` worker processes, each
an ``echo.TcpClient`` on loopback, into a FIFO server whose learner reads every batch;
once with the ragged example and once with one fixed ``uint8`` leaf of the rollouts' mean
bytes (no ragged leaf, the same batch size), each over TCP (``shared_memory=False``) and
through same-host shared memory (``shared_memory=True``).

The workers (``multiprocessing`` ``spawn``: this interpreter and ``sys.path``) are started
once and kept for every round; each makes the suite's pool of rollouts (the same seed as the
learner, so the learner can check what it gets) and the fixed payloads before any clock
starts, and per round connects a client, waits for the common start, calls ``send()`` for
each rollout of its pool in turn (from its own offset) until the common end or
``max_samples``, then ``close()`` (which waits until the server stored everything) and
reports. Every loop is bounded in count and time, each worker has a watchdog, and the
workers this module started are the only processes it ends (by their ``Process``, so by
PID), on errors too.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import numpy as np

from benches import common as c
from benches.suites.ragged_data import Rollouts, touch

HOST = "127.0.0.1"
TAIL_S = 0.3  # workers send this long past the window's end: the window never sees a drain
TIMEOUT_S = 30.0  # connect, a blocked send, close, a worker's answer
# ragged; fixed: one uint8 leaf of the rollouts' mean bytes; leaves: the rollouts' four
# leaves at fixed (mean) lengths (``Rollouts.fixed_leaves``).
KINDS = ("ragged", "fixed", "leaves")
PATHS = ("tcp", "shm")


def run_key(kind: str, path: str) -> str:
    """A run's key in the results: ``ragged``, ``fixed`` (TCP), ``ragged_shm``, ``fixed_shm``."""
    return kind if path == "tcp" else f"{kind}_{path}"


def fixed_payloads(pool: Rollouts) -> list[np.ndarray]:
    """One ``uint8`` payload of the pool's mean bytes per rollout, random, with the rollout's
    index in its first 4 bytes (little-endian), so a reader can check what it got."""
    mean = round(pool.mean_bytes())
    rng = np.random.default_rng(1)
    out = []
    for i in range(pool.n):
        a = rng.integers(0, 256, mean, dtype=np.uint8)
        a[:4] = np.frombuffer(np.uint32(i).tobytes(), np.uint8)
        out.append(a)
    return out


def example(echo: Any, p: dict[str, Any], kind: str, mean: int) -> dict[str, Any]:
    if kind == "fixed":
        return {"payload": np.zeros(mean, np.uint8)}
    if kind == "leaves":
        return {k: np.zeros_like(v) for k, v in Rollouts(p).fixed_leaves()[0].items()}
    return {
        "prompt": echo.Ragged(int(p["prompt_max"]), np.int32),
        "tokens": echo.Ragged(int(p["completion_max"]), np.int32, group="completion"),
        "logp": echo.Ragged(int(p["completion_max"]), np.float32, group="completion"),
        "reward": np.zeros((), np.float32),
    }


# --------------------------------------------------------------------------- worker


def _worker(wid: int, k: int, conn: Any, p: dict[str, Any], echo_file: str, limit_s: float) -> None:
    """A worker process: makes the pool, answers ``("made",)``; then per ``("round", cmd)``
    connects a client and answers ``("ready", ok, error)``, on ``("go", t_end)`` sends until
    ``t_end`` (``time.monotonic()``), closes and answers ``("done", report)``; ``("quit",)``
    (or the learner gone) ends it. A watchdog ends it after ``limit_s``."""
    c.start_watchdog(limit_s, f"ragged tcp worker {wid}")
    import echo

    pool = Rollouts(p)
    items = {
        "ragged": [pool.sample(i) for i in range(pool.n)],
        "fixed": [{"payload": a} for a in fixed_payloads(pool)],
        "leaves": pool.fixed_leaves(),
    }
    sizes = {
        "ragged": [pool.sample_bytes(i) for i in range(pool.n)],
        "fixed": [int(a["payload"].nbytes) for a in items["fixed"]],
        "leaves": [sum(int(v.nbytes) for v in a.values()) for a in items["leaves"]],
    }
    mean = int(items["fixed"][0]["payload"].nbytes)
    conn.send(("made",))
    for _ in range(100_000):  # commands
        try:
            if not conn.poll(limit_s):
                return
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] != "round":
            return
        cmd = msg[1]
        kind, path = cmd["kind"], cmd["path"]
        client, error = None, None
        if os.path.realpath(echo.__file__ or "") != echo_file:
            error = f"worker imported echo from {echo.__file__}, the learner from {echo_file}"
        else:
            try:
                client = echo.TcpClient(
                    HOST, cmd["port"], example(echo, p, kind, mean),
                    connect_timeout=TIMEOUT_S, shared_memory=path == "shm",
                    wire_compression=bool(cmd.get("wire", True)),
                )  # fmt: skip
                if client.transport_path != path:
                    error = f"connected over {client.transport_path}, not {path}"
            except (OSError, ValueError, TypeError, RuntimeError) as e:
                error = f"connect: {type(e).__name__}: {e}"
        try:
            conn.send(("ready", error is None, error))
            if not conn.poll(TIMEOUT_S + 30.0):
                return
            go = conn.recv()
        except (EOFError, OSError):
            return
        t_end = go[1] if go[0] == "go" and error is None else 0.0
        start = wid * pool.n // k
        report = _send(client, items[kind], sizes[kind], start, t_end, int(p["max_samples"]))
        report["wid"] = wid
        report["error"] = report["error"] or error
        try:
            conn.send(("done", report))
        except (EOFError, OSError):
            return


def _send(
    client: Any, items: list[Any], sizes: list[int], j: int, t_end: float, cap: int
) -> dict[str, Any]:
    """``send()`` of ``items[j]``, ``items[j + 1]``, ... (cycling) until ``t_end`` or ``cap``
    samples, then ``close()``; ``client`` None: nothing sent."""
    r: dict[str, Any] = {"sent": 0, "bytes": 0, "error": None, "send_s": 0.0, "cpu_s": 0.0}
    r["close_ok"] = None
    if client is None:
        return r
    sent = nbytes = 0
    n = len(items)
    clock = time.monotonic
    send = client.send
    cpu0, w0 = time.process_time(), clock()
    try:
        while sent < cap and clock() < t_end:
            send(items[j], timeout=TIMEOUT_S)
            nbytes += sizes[j]
            sent += 1
            j = j + 1 if j + 1 < n else 0
        r["send_s"] = clock() - w0
    except (OSError, ValueError, TypeError, RuntimeError) as e:
        r["error"] = f"send: {type(e).__name__}: {e}"
    finally:
        try:
            r["close_ok"] = bool(client.close(timeout=TIMEOUT_S))
        except (OSError, ValueError, TypeError, RuntimeError) as e:
            r["error"] = r["error"] or f"close: {type(e).__name__}: {e}"
    r["cpu_s"] = time.process_time() - cpu0
    r.update(sent=sent, bytes=nbytes)
    return r


class Workers:
    """``k`` worker processes, each with a pipe; ``stop()`` ends them (by their ``Process``,
    so by PID), forcing those that do not quit."""

    def __init__(self, k: int, p: dict[str, Any], limit_s: float) -> None:
        import multiprocessing as mp

        import echo

        ctx = mp.get_context("spawn")
        echo_file = os.path.realpath(echo.__file__ or "")
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for wid in range(k):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_worker, args=(wid, k, theirs, p, echo_file, limit_s),
                name=f"bench-ragged-tcp-{wid}", daemon=True,
            )  # fmt: skip
            self.conns.append(mine)
            self.procs.append(proc)

    def start(self) -> None:
        for proc in self.procs:
            proc.start()

    def collect(self, timeout: float) -> list[Any]:
        """Every worker's next answer (RuntimeError if one has none within ``timeout`` in
        all)."""
        end = time.monotonic() + timeout
        out = []
        for wid, conn in enumerate(self.conns):
            if not conn.poll(max(0.0, end - time.monotonic())):
                raise RuntimeError(f"ragged tcp worker {wid} did not answer in {timeout:.0f} s")
            out.append(conn.recv())
        return out

    def tell(self, msg: Any) -> None:
        for conn in self.conns:
            conn.send(msg)

    def stop(self) -> list[int]:
        """``quit``, 10 s to exit, then terminate (and kill) by PID; returns the PIDs that had
        to be forced."""
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("quit",))
        end = time.monotonic() + 10.0
        for proc in self.procs:
            if proc.pid is not None:
                proc.join(timeout=max(0.1, end - time.monotonic()))
        forced = [proc.pid for proc in self.procs if proc.pid is not None and proc.is_alive()]
        for proc in self.procs:
            if proc.pid is not None and proc.is_alive():
                proc.terminate()
                proc.join(timeout=5.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=5.0)
        for conn in self.conns:
            conn.close()
        return forced


# --------------------------------------------------------------------------- learner


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each of this process's threads, summed by name (the
    digits dropped: ``echo-conn-3`` and ``echo-conn-7`` are one ``echo-conn-``)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat", encoding="utf-8") as f:
                    stat = f.read()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu = (int(fields[11]) + int(fields[12])) / tick
            key = name.rstrip("0123456789")
            out[key] = out.get(key, 0.0) + cpu
    return out


def _name_thread(name: bytes) -> None:
    """Names the calling thread for ``/proc`` (Linux ``prctl(PR_SET_NAME)``), so its CPU time
    is told apart from the main thread's; nothing where that fails."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        import ctypes

        ctypes.CDLL(None).prctl(15, name[:15], 0, 0, 0)


def check_leaves(batch: dict[str, Any], leaves: list[dict[str, np.ndarray]]) -> bool:
    """The first and last rollouts of a batch of fixed-shape rollouts are those their
    rewards name."""
    rewards = np.asarray(batch["reward"])
    if rewards.ndim != 1 or not len(rewards):
        return False
    for row in (0, len(rewards) - 1):
        i = int(rewards[row])
        if not 0 <= i < len(leaves):
            return False
        if not all(np.array_equal(batch[k][row], v) for k, v in leaves[i].items()):
            return False
    return True


def _check_fixed(payload: np.ndarray, fixed: list[np.ndarray]) -> bool:
    """The first and last rows of a fixed batch are the payloads their stamps name."""
    if payload.ndim != 2 or not len(payload):
        return False
    for row in (payload[0], payload[-1]):
        i = int(row[:4].view("<u4")[0])
        if i >= len(fixed) or not np.array_equal(row, fixed[i]):
            return False
    return True


def _consume(
    server: Any, kind: str, pool: Rollouts, fixed: list[np.ndarray], check: Any, stop: Any,
    out: dict[str, Any],
) -> None:  # fmt: skip
    """The learner's thread: ``sample()`` batch after batch until the server closes (or
    ``stop``), reading every byte of every batch and checking each."""
    _name_thread(b"bench-learner")
    leaves = pool.fixed_leaves() if kind == "leaves" else []
    acc = 0
    errors: list[str] = out["errors"]
    clock = time.perf_counter
    for _ in range(10_000_000):
        if stop.is_set():
            break
        t0 = clock()
        try:
            s = server.sample(timeout=1.0)
        except TimeoutError:
            continue
        except (RuntimeError, ValueError) as e:
            errors.append(f"sample: {type(e).__name__}: {e}")
            break
        if s is None:
            break
        t1 = clock()
        batch = s.batch
        if kind == "ragged":
            arrays = [
                batch["prompt"].values, batch["tokens"].values, batch["logp"].values,
                batch["reward"],
            ]  # fmt: skip
            ok = check(batch, pool)
        elif kind == "leaves":
            arrays = [batch["prompt"], batch["tokens"], batch["logp"], batch["reward"]]
            ok = check_leaves(batch, leaves)
        else:
            arrays = [batch["payload"]]
            ok = _check_fixed(batch["payload"], fixed)
        acc ^= touch(arrays)
        t2 = clock()
        if not ok:
            out["bad"] += 1
            if len(errors) < 5:
                errors.append(f"batch {out['batches']}: not what was sent")
        out["sample_s"] += t1 - t0
        out["read_s"] += t2 - t1
        out["bytes"] += sum(int(np.asarray(a).nbytes) for a in arrays)
        out["samples"] += s.num_samples
        out["batches"] += 1
        out["cpu_s"] = time.thread_time()
        s = batch = None
    out["acc"] = acc % 7


def _round(
    workers: Workers, kind: str, path: str, rnd: int, p: dict[str, Any], pool: Rollouts,
    fixed: list[np.ndarray], check: Any, log: Any, *, compress: Any = None, wire: bool = True,
    relay_mbit: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One window: a FIFO server of ``kind`` on loopback (with ``compress=``), the workers
    connected and sending over ``path`` (compressing what it names when ``wire``; through a
    relay of ``relay_mbit`` Mbit/s each way, 0 for no limit, when given), the learner reading;
    the rate is what the learner read during the window."""
    import echo

    k = len(workers.procs)
    batch_size = int(p["ingest_batch"])
    mean = int(fixed[0].nbytes)
    transport = echo.TcpTransport(port=0, host=HOST)
    server = echo.Server(
        example(echo, p, kind, mean), batch_size, transport=transport, compress=compress
    )
    warmup, seconds = float(p["tcp_warmup"]), float(p["tcp_seconds"])
    relay = None
    guard = c.call_later(warmup + seconds + 6 * TIMEOUT_S, server.close)
    consumed: dict[str, Any] = dict(samples=0, bytes=0, batches=0, bad=0, errors=[])
    consumed.update(sample_s=0.0, read_s=0.0, cpu_s=0.0)
    stop = threading.Event()
    consumer = None
    reports: list[dict[str, Any]] = []
    failed: list[str] = []
    try:
        server.start()
        port = server.port
        if port is None:
            raise RuntimeError("the server has no port after start()")
        if relay_mbit is not None:
            from benches.suites.compression_wire import Relay

            relay = Relay(int(port), relay_mbit, warmup + seconds + 6 * TIMEOUT_S)
            port = relay.port
        cmd = {"port": int(port), "kind": kind, "path": path, "wire": wire}
        workers.tell(("round", cmd))
        ready = workers.collect(TIMEOUT_S + 10.0)
        failed = [str(r[2]) for r in ready if not r[1]]
        consumer = threading.Thread(
            target=_consume, args=(server, kind, pool, fixed, check, stop, consumed),
            name="bench-learner", daemon=True,
        )  # fmt: skip
        consumer.start()
        t0 = time.monotonic() + 0.05
        w0, w1 = t0 + warmup, t0 + warmup + seconds
        workers.tell(("go", w1 + TAIL_S if not failed else 0.0))
        time.sleep(max(0.0, w0 - time.monotonic()))
        snap = dict(consumed)
        st0, th0, cpu0, c0 = server.stats(), _thread_cpu(), time.process_time(), time.monotonic()
        time.sleep(max(0.0, w1 - time.monotonic()))
        end = dict(consumed)
        st1, th1, cpu1, c1 = server.stats(), _thread_cpu(), time.process_time(), time.monotonic()
        answers = workers.collect(seconds + TAIL_S + 3 * TIMEOUT_S)
        reports = [a[1] for a in answers]
        sent = sum(r["sent"] for r in reports)
        # every client closed (so everything it sent was stored): the FIFO holds the rest
        wait_end = time.monotonic() + 10.0
        while time.monotonic() < wait_end and server.stats().samples_inserted_total < sent:
            time.sleep(0.01)
        settled = server.stats()
        inserted_total = int(settled.samples_inserted_total)
        # Counted before a frame's samples are (both after it is stored): all of them here.
        compressed_total = int(settled.samples_received_compressed_total)
        server.close(drain=True)
        consumer.join(timeout=TIMEOUT_S)
    finally:
        stop.set()
        guard.cancel()
        server.close()
        if relay is not None:
            relay.close()
        if consumer is not None:
            consumer.join(timeout=10.0)
    dt = c1 - c0
    samples = end["samples"] - snap["samples"]
    nbytes = end["bytes"] - snap["bytes"]
    batches = end["batches"] - snap["batches"]
    sent = sum(r["sent"] for r in reports)
    sent_bytes = sum(r["bytes"] for r in reports)
    errors = [str(r["error"]) for r in reports if r["error"]] + failed + consumed["errors"]
    # A fixed-shape FIFO server's close(drain=True) hands out full batches only (it drops
    # the last partial one); a ragged one hands out what is left.
    want = sent if kind == "ragged" else sent // batch_size * batch_size
    ok = not errors and sent > 0 and inserted_total == sent and consumed["samples"] == want
    ok = ok and consumed["bad"] == 0 and all(r["close_ok"] for r in reports)
    ok = ok and all(r["sent"] > 0 for r in reports)
    ok = ok and (kind != "ragged" or consumed["bytes"] == sent_bytes)
    cpu = {
        name: round((th1.get(name, 0.0) - th0.get(name, 0.0)) / dt, 3)
        for name in sorted(set(th0) | set(th1))
        if th1.get(name, 0.0) - th0.get(name, 0.0) > 0
    }
    r = {
        "kind": kind,
        "path": path,
        "round": rnd,
        "workers": k,
        "window_s": dt,
        "samples": samples,
        "bytes": nbytes,
        "samples_per_s": c.rate(samples, dt),
        "gb_per_s": c.rate(nbytes, dt) / 1e9,
        "inserted_per_s": c.rate(st1.samples_inserted_total - st0.samples_inserted_total, dt),
        "inserted_in_window": st1.samples_inserted_total - st0.samples_inserted_total,
        "compressed_samples": st1.samples_received_compressed_total
        - st0.samples_received_compressed_total,
        "compressed_bytes": st1.compressed_bytes_received_total
        - st0.compressed_bytes_received_total,
        "batches_in_window": batches,
        "learner_cpu_cores": round(c.rate(cpu1 - cpu0, dt), 3),
        "learner_thread_cores": cpu,
        "us_in_sample_call": c.rate((end["sample_s"] - snap["sample_s"]) * 1e6, batches),
        "us_per_batch_read": c.rate((end["read_s"] - snap["read_s"]) * 1e6, batches),
        "learner_cpu_us_per_batch": c.rate((end["cpu_s"] - snap["cpu_s"]) * 1e6, batches),
        "worker_cpu_us_per_sample": c.rate(sum(r["cpu_s"] for r in reports) * 1e6, sent),
        "sent": sent,
        "sent_bytes": sent_bytes,
        "inserted_total": inserted_total,
        "compressed_total": compressed_total,
        "consumed_samples": consumed["samples"],
        "consumed_bytes": consumed["bytes"],
        "bad_batches": consumed["bad"],
        "errors": errors[:5],
        "correct": bool(ok),
    }
    log(
        f"{path} {kind} x{k} #{rnd + 1}: {r['samples_per_s']:,.0f} samples/s, "
        f"{r['gb_per_s']:.2f} GB/s, learner {r['learner_cpu_cores']:.2f} cores, workers "
        f"{r['worker_cpu_us_per_sample']:.1f} us CPU/sample{'' if ok else ' INCORRECT'}"
        + (f": {errors[:2]}" if errors else "")
    )
    return r


def measure_tcp(p: dict[str, Any], check: Any, log: Any) -> dict[str, Any]:
    """Every round (``repeats`` of each kind over each of ``tcp_paths``, rotating which kind
    goes first), one pool of ``tcp_workers`` workers for all; the best window of each kind
    and path."""
    pool = Rollouts(p)
    fixed = fixed_payloads(pool)
    k = int(p["tcp_workers"])
    repeats = int(p["repeats"])
    per_round = float(p["tcp_warmup"]) + float(p["tcp_seconds"]) + TAIL_S + 5.0
    limit = 4 * TIMEOUT_S + 60.0 + per_round * 2 * repeats
    out: dict[str, Any] = {"workers": k, "mean_sample_bytes": int(fixed[0].nbytes), "runs": {}}
    out["leaves_lengths"] = list(pool.leaves_lengths())
    workers = Workers(k, p, limit)
    correct = True
    try:
        t0 = time.monotonic()
        workers.start()
        made = workers.collect(TIMEOUT_S + 4.0 * k)
        if any(m[0] != "made" for m in made):
            raise RuntimeError(f"a worker did not start: {made}")
        out["workers_started_s"] = round(time.monotonic() - t0, 2)
        log(f"tcp: {k} workers up in {out['workers_started_s']:.1f} s")
        for rnd in range(repeats):
            for path in p["tcp_paths"]:
                for kind in KINDS[rnd % len(KINDS) :] + KINDS[: rnd % len(KINDS)]:
                    r = _round(workers, kind, path, rnd, p, pool, fixed, check, log)
                    correct = correct and r["correct"]
                    out["runs"].setdefault(run_key(kind, path), []).append(r)
    finally:
        out["workers_forced"] = workers.stop()
    best: dict[str, Any] = {}
    for kind, runs in out["runs"].items():
        top = max(runs, key=lambda r: r["gb_per_s"])
        keep = (
            *("samples_per_s", "gb_per_s", "samples", "learner_cpu_cores", "us_in_sample_call"),
            *("us_per_batch_read", "learner_cpu_us_per_batch", "worker_cpu_us_per_sample"),
            *("learner_thread_cores", "batches_in_window"),
        )
        best[kind] = {key: top[key] for key in keep}
        best[kind]["spread"] = max(r["gb_per_s"] for r in runs) / max(
            1e-12, min(r["gb_per_s"] for r in runs)
        )
    out["best"] = best
    for path in p["tcp_paths"]:
        rg = best.get(run_key("ragged", path), {})
        for kind, ratio in (("fixed", "ratio"), ("leaves", "ratio_leaves")):
            fx = best.get(run_key(kind, path), {})
            if rg.get("gb_per_s") and fx.get("gb_per_s"):
                out[run_key(ratio, path)] = rg["gb_per_s"] / fx["gb_per_s"]
    want = {run_key(kind, path) for kind in KINDS for path in p["tcp_paths"]}
    out["correct"] = correct and not out["workers_forced"] and set(best) == want
    return out
