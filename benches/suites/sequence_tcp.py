"""The TCP part of the sequence-table benchmark (:mod:`benches.suites.sequence_tables`):
steps sent by ``TcpClient`` worker processes (``spawn``: this interpreter and ``sys.path``)
into a sequence table over TCP or same-host shared memory, with a consumer sampling windows
and checking them, per mode (whole steps or single samples) and path; its summary and its
table. Loopback only; every loop is bounded in count and time, and the worker processes it
starts are the only ones it ends.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np

from benches import common as h
from benches.suites.sequence_data import (
    ID_STRIDE,
    Frames,
    example,
    log,
    obs_stamps,
    step_bytes,
    touch,
)

# --------------------------------------------------------------------------- tcp

TCP_HOST = "127.0.0.1"
TCP_MODES = ("steps", "samples")
TCP_PATHS = ("tcp", "shm")  # TcpClient(shared_memory=False / True)
TCP_EPISODE = (200, 400)  # a worker's episode lengths: uniform in [min, max]
TCP_TAIL_S = 0.3  # workers send this long past the window's end
TCP_TIMEOUT_S = 30.0  # connect, send (window full), close, reports
TCP_MAX_CONSUMER_BATCHES = 10_000_000
TCP_CHECK_EVERY = 256  # the consumer checks batches 0, 1 and every 256th


def _tcp_worker(wid: int, conn: Any, echo_file: str, seed: int, limit_s: float) -> None:
    """A worker process, kept for every round: ``("round", cmd)`` connects a client and
    answers ``("ready", ok, error)``; ``("go", t_end)`` sends one step per ``send()`` until
    ``t_end`` (``time.monotonic()``), closes (flushing) and answers the report;
    ``("quit",)`` ends it. A watchdog ends it after ``limit_s``."""
    import os

    import echo

    h.start_watchdog(limit_s, f"bench_sequence: tcp worker {wid}")
    for _ in range(100_000):  # commands
        if not conn.poll(limit_s):
            return
        msg = conn.recv()
        if msg[0] != "round":
            return
        cmd = msg[1]
        client, error = None, None
        if os.path.realpath(echo.__file__ or "") != echo_file:
            error = f"worker imported echo from {echo.__file__}, the learner from {echo_file}"
        else:
            try:
                client = echo.TcpClient(
                    TCP_HOST, cmd["port"], example(cmd["kind"]),
                    connect_timeout=TCP_TIMEOUT_S, shared_memory=cmd["path"] == "shm",
                )  # fmt: skip
            except (OSError, ValueError, TypeError, RuntimeError) as e:
                error = f"connect: {type(e).__name__}: {e}"
        if client is not None and client.transport_path != cmd["path"]:
            error = f"connected over {client.transport_path}, asked for {cmd['path']}"
        conn.send(("ready", error is None, error))
        if not conn.poll(TCP_TIMEOUT_S + limit_s / 10):
            return
        go = conn.recv()
        t_end = go[1] if go[0] == "go" and error is None else 0.0
        report = _tcp_send(wid, client, cmd, t_end, seed)
        report["error"] = report["error"] or error
        conn.send(("done", report))


def _tcp_send(
    wid: int, client: Any, cmd: dict[str, Any], t_end: float, seed: int
) -> dict[str, Any]:
    """The send loop of one round (``client`` None: nothing to send), then ``close()``."""
    kind, mode, period = cmd["kind"], cmd["mode"], cmd["period"]
    tree = example(kind)
    frames = Frames(kind, 1, seed)
    obs_bytes = tree["obs"].reshape(-1).view(np.uint8)
    obs_bytes[:] = frames.pool[0]
    stamp = obs_bytes[:8].view("<i8")
    action, discount = tree["action"], tree["discount"]
    rng = np.random.default_rng([seed, 5, wid, cmd["round"]])
    lo, hi = TCP_EPISODE
    r: dict[str, Any] = {"wid": wid, "sent": 0, "ends": 0, "windows": 0, "episodes": 0}
    r.update(error=None, send_s=0.0, cpu_s=0.0, close_ok=None)
    if client is None:
        return r
    sent = ends = windows = 0
    ep_start = 0
    ep_end = int(rng.integers(lo, hi + 1))
    base = wid * ID_STRIDE
    clock = time.monotonic
    send = client.send
    cpu0, w0 = time.process_time(), clock()
    try:
        while sent < ID_STRIDE - 1 and clock() < t_end:
            step_id = base + sent
            action[()] = step_id
            stamp[0] = step_id
            last = sent + 1 == ep_end
            discount[()] = 0.0 if last else 1.0
            if mode == "steps":
                send(tree, timeout=TCP_TIMEOUT_S, end_episode=last)
            else:
                send(tree, timeout=TCP_TIMEOUT_S)
            sent += 1
            if last:
                ends += 1
                windows += -(-(ep_end - ep_start) // period)
                ep_start, ep_end = ep_end, ep_end + int(rng.integers(lo, hi + 1))
        r["send_s"] = clock() - w0
    except (OSError, ValueError, TypeError, RuntimeError) as e:
        r["error"] = f"send: {type(e).__name__}: {e}"
    finally:
        try:
            r["close_ok"] = bool(client.close(timeout=TCP_TIMEOUT_S))
        except (OSError, ValueError, TypeError, RuntimeError) as e:
            r["error"] = r["error"] or f"close: {type(e).__name__}: {e}"
    r["cpu_s"] = time.process_time() - cpu0
    partial = sent - ep_start  # the open episode, ended (truncated) by close()
    r.update(sent=sent, ends=ends, episodes=ends + (partial > 0))
    r["windows"] = windows + -(-partial // period)
    return r


class _TcpWorkers:
    """``k`` worker processes (``spawn``: this interpreter and ``sys.path``), each with a
    pipe; ``stop()`` ends them (by their ``Process``, so by PID), forcing those that hang."""

    def __init__(self, k: int, seed: int, limit_s: float) -> None:
        import multiprocessing as mp
        import os

        import echo

        ctx = mp.get_context("spawn")
        echo_file = os.path.realpath(echo.__file__ or "")
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for wid in range(k):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(
                target=_tcp_worker, args=(wid, theirs, echo_file, seed, limit_s),
                name=f"bench-sequence-tcp-{wid}", daemon=True,
            )  # fmt: skip
            self.conns.append(mine)
            self.procs.append(p)

    def start(self) -> None:
        for p in self.procs:
            p.start()

    def ask(self, msgs: list[Any], timeout: float) -> list[Any]:
        """Sends ``msgs[i]`` to worker ``i``, returns their answers (RuntimeError if one
        does not answer within ``timeout`` in all)."""
        for c, m in zip(self.conns, msgs, strict=True):
            c.send(m)
        end = time.monotonic() + timeout
        out = []
        for wid, c in enumerate(self.conns):
            if not c.poll(max(0.0, end - time.monotonic())):
                raise RuntimeError(f"tcp worker {wid} did not answer within {timeout:.0f} s")
            out.append(c.recv())
        return out

    def stop(self) -> list[int]:
        """Ends every worker: ``quit``, 10 s to exit, then terminate/kill by PID; returns
        the PIDs that had to be forced."""
        for c in self.conns:
            with contextlib.suppress(OSError, ValueError):
                c.send(("quit",))
        end = time.monotonic() + 10.0
        for p in self.procs:
            if p.pid is not None:
                p.join(timeout=max(0.1, end - time.monotonic()))
        forced = [p.pid for p in self.procs if p.pid is not None and p.is_alive()]
        for p in self.procs:
            if p.pid is not None and p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5.0)
        for c in self.conns:
            c.close()
        return forced


def _tcp_check(s: Any, mode: str, length: int) -> str | None:
    """What is wrong with a batch of a tcp round (None: nothing): every step's obs stamp is
    its action id; in a window, real steps are consecutive ids of one worker's stream."""
    action = np.asarray(s.batch["action"])
    if mode == "samples":
        ok = np.array_equal(obs_stamps(np.asarray(s.batch["obs"])[:, None]), action[:, None])
        return None if ok else "obs stamps differ from action"
    mask = np.asarray(s.mask)
    got = obs_stamps(np.asarray(s.batch["obs"]))
    for i in range(action.shape[0]):
        real = int(mask[i].sum())
        first = int(action[i, 0])
        if real < 1 or not mask[i, :real].all():
            return f"window {i}: mask is not a prefix"
        if not np.array_equal(action[i, :real], first + np.arange(real)):
            return f"window {i}: action ids not consecutive: {action[i, :real].tolist()}"
        if not np.array_equal(got[i, :real], action[i, :real]):
            return f"window {i}: obs stamps differ from action"
        if int(s.stream[i]) >> 32 < 1 or int(s.stream[i]) & 0xFFFF_FFFF != 0:
            return f"window {i}: stream {int(s.stream[i]):#x} is not a client's row 0"
    return None


def _tcp_consume(server: Any, mode: str, length: int, stop: Any, out: dict[str, Any]) -> None:
    """The learner's consumer thread: ``sample()`` batch after batch until ``stop`` (or the
    server closes), reading every cache line of ``obs``; checks some batches."""
    batches = sink = 0
    errors: list[str] = out.setdefault("errors", [])
    for _ in range(TCP_MAX_CONSUMER_BATCHES):
        if stop.is_set():
            break
        try:
            s = server.sample(timeout=1.0)
        except TimeoutError:
            continue
        except (RuntimeError, ValueError) as e:
            errors.append(f"sample: {type(e).__name__}: {e}")
            break
        if s is None:
            break
        sink += touch(s.batch["obs"])
        if batches < 2 or batches % TCP_CHECK_EVERY == 0:
            problem = _tcp_check(s, mode, length)
            out["checked"] = out.get("checked", 0) + 1
            if problem and len(errors) < 5:
                errors.append(f"batch {batches}: {problem}")
        batches += 1
        out["batches"] = batches
        out["obs_bytes"] = out.get("obs_bytes", 0) + s.batch["obs"].nbytes
        s = None
    out["sink"] = sink % 7


def tcp_round(
    workers: _TcpWorkers, kind: str, mode: str, path: str, rnd: int, args: Any
) -> dict[str, Any]:
    """One round: a server of ``mode`` (a sequence table, or a replay table of the same
    step), the workers connected over ``path``, the inserts counted over the window."""
    import threading

    import echo

    k = len(workers.procs)
    n = args.tcp_max_size
    transport = echo.TcpTransport(port=0, host=TCP_HOST)
    if mode == "steps":
        server = echo.Server(
            example(kind), batch_size=args.batch_size, transport=transport,
            sequence=echo.Sequence(args.length, period=args.period), sampler=echo.Uniform(),
            max_size=n, seed=args.seed,
        )  # fmt: skip
    else:
        server = echo.Server(
            example(kind), args.batch_size, transport=transport, sampler=echo.Uniform(),
            max_size=n, seed=args.seed,
        )  # fmt: skip
    limit = args.tcp_warmup + args.tcp_seconds + 4 * TCP_TIMEOUT_S
    guard = h.call_later(limit, server.close)
    out: dict[str, Any] = {"kind": kind, "mode": mode, "path": path, "round": rnd, "workers": k}
    consumed: dict[str, Any] = {}
    stop = threading.Event()
    consumer = None
    counter = "steps_inserted_total" if mode == "steps" else "samples_inserted_total"
    try:
        server.start()
        port = server.port
        if port is None:
            raise RuntimeError("the server has no port after start()")
        cmd = {"port": int(port), "kind": kind, "mode": mode, "path": path,
               "period": args.period, "round": rnd}  # fmt: skip
        ready = workers.ask([("round", cmd)] * k, TCP_TIMEOUT_S + 10)
        failed = [r[2] for r in ready if not r[1]]
        if args.tcp_consumer:
            consumer = threading.Thread(
                target=_tcp_consume, args=(server, mode, args.length, stop, consumed),
                name="bench-sequence-consumer", daemon=True,
            )  # fmt: skip
            consumer.start()
        t0 = time.monotonic() + 0.05
        w0, w1 = t0 + args.tcp_warmup, t0 + args.tcp_warmup + args.tcp_seconds
        t_end = w1 + TCP_TAIL_S if not failed else 0.0
        for c in workers.conns:
            c.send(("go", t_end))
        time.sleep(max(0.0, w0 - time.monotonic()))
        st0, c0, cpu0 = server.stats(), time.monotonic(), time.process_time()
        time.sleep(max(0.0, w1 - time.monotonic()))
        st1, c1, cpu1 = server.stats(), time.monotonic(), time.process_time()
        b0 = consumed.get("batches", 0)
        reports: list[dict[str, Any]] = []
        end = time.monotonic() + args.tcp_seconds + 3 * TCP_TIMEOUT_S
        for wid, c in enumerate(workers.conns):
            if not c.poll(max(0.0, end - time.monotonic())):
                raise RuntimeError(f"tcp worker {wid} sent no report")
            reports.append(c.recv()[1])
        sent = sum(r["sent"] for r in reports)
        episodes = sum(r["episodes"] for r in reports)
        windows = sum(r["windows"] for r in reports)
        # every step acked and closed: wait (bounded) until the table has them all
        wait_end = time.monotonic() + 10.0
        st = server.stats()
        while time.monotonic() < wait_end:
            st = server.stats()
            if getattr(st, counter) >= sent and (
                mode == "samples" or st.episodes_ended_total >= episodes
            ):
                break
            time.sleep(0.01)
        time.sleep(0.05)
        st = server.stats()
        stop.set()
        b1 = consumed.get("batches", 0)
    finally:
        stop.set()
        guard.cancel()
        server.close()
        if consumer is not None:
            consumer.join(timeout=10.0)
    dt = c1 - c0
    inserted = getattr(st1, counter) - getattr(st0, counter)
    errors = [r["error"] for r in reports if r["error"]] + failed + consumed.get("errors", [])
    got = {
        "inserted": int(getattr(st, counter)),
        "samples_inserted_total": int(st.samples_inserted_total),
        "steps_inserted_total": int(st.steps_inserted_total),
        "episodes_ended_total": int(st.episodes_ended_total),
        "windows_inserted_total": int(st.windows_inserted_total),
        "shm_connections_total": int(st.shm_connections_total),
    }
    ok = not errors and sent > 0 and got["inserted"] == sent
    ok = ok and all(r["close_ok"] for r in reports) and all(r["sent"] > 0 for r in reports)
    ok = ok and got["shm_connections_total"] == (k if path == "shm" else 0)
    if mode == "steps":
        ok = ok and got["episodes_ended_total"] == episodes
        ok = ok and got["windows_inserted_total"] == windows
    out.update(
        window_s=dt,
        inserted_in_window=int(inserted),
        per_s=h.rate(inserted, dt),
        mb_per_s=h.rate(inserted * step_bytes(kind), dt) / 1e6,
        table_at_window_start=int(st0.steps_stored if mode == "steps" else st0.store_size),
        learner_cpu_cores=h.rate(cpu1 - cpu0, dt),
        consumer_batches_per_s=h.rate(b1 - b0, dt) if consumer else None,
        consumer_checked=consumed.get("checked", 0),
        sent=sent,
        ends_sent=sum(r["ends"] for r in reports),
        episodes_expected=episodes,
        windows_expected=windows,
        worker_cpu_us_per_step=h.rate(sum(r["cpu_s"] for r in reports) * 1e6, sent),
        totals=got,
        errors=errors[:5],
        correct=bool(ok),
    )
    return out


def run_tcp(args: Any, deadline: float) -> dict[str, Any]:
    """Every kind and path: ``--tcp-pairs`` pairs of rounds, steps and samples alternating
    (steps first in even pairs, samples first in odd ones), one pool of workers for all."""
    per_round = args.tcp_warmup + args.tcp_seconds + TCP_TAIL_S + 4.0
    limit = 4 * TCP_TIMEOUT_S + per_round * 2 * args.tcp_pairs * len(TCP_PATHS) * len(
        args.tcp_kinds
    )
    workers = _TcpWorkers(args.tcp_workers, args.seed, min(limit, args.max_seconds))
    out: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        workers.start()
        started_s = time.perf_counter() - t0
        for kind in args.tcp_kinds:
            rk: dict[str, Any] = {"step_bytes": step_bytes(kind)}
            for path in TCP_PATHS:
                rounds: list[dict[str, Any]] = []
                for i in range(args.tcp_pairs):
                    for mode in TCP_MODES if i % 2 == 0 else TCP_MODES[::-1]:
                        if time.perf_counter() + per_round + 10 > deadline:
                            rounds.append({"mode": mode, "skipped": "no time left",
                                           "correct": False})  # fmt: skip
                            continue
                        log(f"tcp: {kind} {path} {mode} round {i}, {args.tcp_workers} workers")
                        rounds.append(tcp_round(workers, kind, mode, path, i, args))
                rk[path] = tcp_summary(rounds)
            out[kind] = rk
        out["workers_started_s"] = started_s
    finally:
        out["workers_forced"] = workers.stop()
    return out


def tcp_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: inserts over the summed windows of its rounds; the ratio steps/samples."""
    out: dict[str, Any] = {"rounds": rounds}
    for mode in TCP_MODES:
        mine = [r for r in rounds if r.get("mode") == mode and "per_s" in r]
        n = sum(r["inserted_in_window"] for r in mine)
        secs = sum(r["window_s"] for r in mine)
        out[mode] = {
            "per_s": h.rate(n, secs) if mine else None,
            "per_round": [r["per_s"] for r in mine],
            "window_s": secs,
            "correct": bool(mine) and all(r.get("correct") for r in rounds if r["mode"] == mode),
        }
    a, b = out["steps"]["per_s"], out["samples"]["per_s"]
    out["ratio"] = a / b if a and b else None
    out["target_within_10pct"] = None if out["ratio"] is None else out["ratio"] >= 0.9
    out["correct"] = out["steps"]["correct"] and out["samples"]["correct"]
    return out


def print_tcp(tcp: dict[str, Any], params: dict[str, Any]) -> None:
    print(
        f"# over TCP: {params['tcp_workers']} workers, one send() per step (episodes "
        f"{TCP_EPISODE[0]}-{TCP_EPISODE[1]} steps), max_size {params['tcp_max_size']:,}, "
        f"{params['tcp_pairs']} pair(s) of {params['tcp_seconds']:g} s windows after "
        f"{params['tcp_warmup']:g} s, consumer {'on' if params['tcp_consumer'] else 'off'}"
    )
    rows: list[list[object]] = [
        ["step", "path", "steps/s", "samples/s", "steps/samples", "per round (steps | samples)",
         "correct"],
    ]  # fmt: skip
    for kind, rk in tcp.items():
        if not isinstance(rk, dict):
            continue
        for path in TCP_PATHS:
            r = rk.get(path)
            if not isinstance(r, dict):
                continue
            st, sa = r["steps"], r["samples"]
            per = " ".join(f"{x:,.0f}" for x in st["per_round"]) + " | "
            per += " ".join(f"{x:,.0f}" for x in sa["per_round"])
            rows.append([
                kind, path, h.fmt_num(st["per_s"], ",.0f", 0).strip(),
                h.fmt_num(sa["per_s"], ",.0f", 0).strip(),
                h.fmt_num(r["ratio"], ".3f", 0).strip(), per, r["correct"],
            ])  # fmt: skip
    h.print_columns(rows)
