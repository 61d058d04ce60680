"""The worker processes of the ``params`` suite (:mod:`benches.suites.params`) and the
pytrees they move: the parameters (8 ``float32`` leaves of different sizes, version stamps
that make a torn copy show) and the feeders' small samples.

``python -m benches.suites.params_workers --worker PORT BYTES SHM`` is a parameter fetcher
(one ``TcpClient`` with ``params_example``) that answers commands on its standard input;
``--feeder PORT WID`` sends samples to the learner until told to stop; ``--crowd PORT BYTES
N`` holds N fetcher connections in one process (the ``params-crowd`` suite,
:mod:`benches.suites.params_crowd`). Each has a watchdog, and every loop is bounded in count
and time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import socket
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

from benches import common as c
from echo import TcpClient

HOST = c.HOST
#: The leaves of the parameters: (group, name, share of the bytes); each ``(rows, 128)``.
LEAVES = (
    ("torso", "w0", 0.32),
    ("torso", "w1", 0.24),
    ("lstm", "w_ih", 0.16),
    ("lstm", "w_hh", 0.12),
    ("policy", "w", 0.08),
    ("policy", "b", 0.04),
    ("value", "w", 0.03),
    ("value", "b", 0.01),
)
COLS = 128
STAMP_EVERY = 16_384  # elements: a version stamp every 64 KiB of each leaf
CALL_S = 60.0  # the longest any one fetch, send or command may take
WORKER_WATCHDOG_S = 900.0
MAX_LOOPS = 10**8
CROWD_GRACE_S = 20.0  # how long past its phase a crowd fetch begun in it may take


# --------------------------------------------------------------------------- the pytrees


def shapes(total_bytes: int) -> list[tuple[int, int]]:
    """The shape of each leaf of ``LEAVES`` for about ``total_bytes`` bytes (at least a row)."""
    return [(max(1, round(total_bytes * share / (4 * COLS))), COLS) for _, _, share in LEAVES]


def pytree(total_bytes: int, seed: int | None = None) -> dict[str, Any]:
    """The parameters: random normal leaves (``seed``), or zeros (``None``: an example)."""
    rng = None if seed is None else np.random.default_rng(seed)
    tree: dict[str, Any] = {}
    for (group, name, _), shape in zip(LEAVES, shapes(total_bytes), strict=True):
        leaf = (
            np.zeros(shape, np.float32)
            if rng is None
            else rng.standard_normal(shape, dtype=np.float32)
        )
        tree.setdefault(group, {})[name] = leaf
    return tree


def leaves(tree: dict[str, Any]) -> list[np.ndarray]:
    """The leaves of a parameter pytree in ``LEAVES`` order."""
    return [tree[group][name] for group, name, _ in LEAVES]


def nbytes(tree: dict[str, Any]) -> int:
    return sum(int(leaf.nbytes) for leaf in leaves(tree))


def digest(tree: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for leaf in leaves(tree):
        h.update(np.ascontiguousarray(leaf).data)
    return h.hexdigest()


def stamp(tree: dict[str, Any], version: int) -> None:
    """Writes ``version`` into every ``STAMP_EVERY``-th element of every leaf (and its last),
    in place: two versions differ in every 64 KiB, so a copy mixing them shows."""
    for leaf in leaves(tree):
        flat = leaf.reshape(-1)
        flat[::STAMP_EVERY] = version
        flat[-1] = version


def torn_leaves(tree: dict[str, Any], version: int) -> int:
    """How many leaves of a fetched copy carry a stamp other than ``version``."""
    bad = 0
    for leaf in leaves(tree):
        flat = leaf.reshape(-1)
        if flat[-1] != version or np.any(flat[::STAMP_EVERY] != version):
            bad += 1
    return bad


def sample_example() -> dict[str, Any]:
    """The feeders' small nested sample: 7 leaves, 141 bytes."""
    return {
        "obs": {"a": np.zeros(16, np.float32), "b": np.zeros(8, np.float32)},
        "act": {"a": np.zeros((), np.int64), "b": np.zeros(2, np.int64)},
        "rew": np.zeros((), np.float32),
        "done": np.zeros((), np.bool_),
        "meta": np.zeros(2, np.float64),
    }


def sample_bytes() -> int:
    """The bytes of one sample of ``sample_example``."""
    return sum(int(leaf.nbytes) for leaf in _leaves_of(sample_example()))


def _leaves_of(tree: dict[str, Any]) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for value in tree.values():
        out += _leaves_of(value) if isinstance(value, dict) else [value]
    return out


# --------------------------------------------------------------------------- worker processes


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _timed_fetches(client: TcpClient, n: int, version: int, expected: str) -> dict[str, Any]:
    """``n`` timed ``params()`` calls, each copy's digest checked after its timing."""
    times: list[float] = []
    bad = 0
    for _ in range(n):
        t = time.perf_counter()
        got_version, tree = client.params(min_version=version, timeout=CALL_S)
        times.append(time.perf_counter() - t)
        if got_version != version or digest(tree) != expected:
            bad += 1
    return {"seconds": times, "bad": bad}


def _blast(port: int, n: int, size: int) -> dict[str, Any]:
    """The loopback reference: ``n`` times a one-byte request, then ``size`` bytes
    ``recv_into`` a preallocated buffer."""
    buf = bytearray(size)
    view = memoryview(buf)
    times: list[float] = []
    with socket.create_connection((HOST, port), timeout=CALL_S) as sock:
        for _ in range(n):
            t = time.perf_counter()
            sock.sendall(b"x")
            got = 0
            for _ in range(MAX_LOOPS):
                if got >= size:
                    break
                k = sock.recv_into(view[got:], size - got)
                if k == 0:
                    raise ConnectionError(f"blast: EOF after {got} of {size} bytes")
                got += k
            times.append(time.perf_counter() - t)
    return {"seconds": times, "bad": 0 if buf[0] == 7 and buf[-1] == 7 else 1}


def _fetch_loop(client: TcpClient, mode: str, end: float) -> dict[str, Any]:
    """Fetches until ``end`` (monotonic): the next version (``newest``) or again at once
    (``back-to-back``); each copy's stamps checked, versions never going back."""
    versions: list[int] = []
    fetch_s: list[float] = []
    torn, backwards, last = 0, 0, 0
    for _ in range(MAX_LOOPS):
        left = end - time.monotonic()
        if left <= 0:
            break
        wanted = last + 1 if mode == "newest" else max(last, 1)
        t = time.perf_counter()
        try:
            version, tree = client.params(min_version=wanted, timeout=min(left, 0.25))
        except TimeoutError:
            continue
        fetch_s.append(time.perf_counter() - t)
        torn += torn_leaves(tree, version)
        backwards += version < last
        last = max(last, version)
        versions.append(version)
    return {
        "fetches": len(versions),
        "first_version": versions[0] if versions else None,
        "last_version": last,
        "distinct_versions": len(set(versions)),
        "torn_leaves": torn,
        "backwards": backwards,
        "fetch_p50_ms": 1e3 * statistics.median(fetch_s) if fetch_s else None,
        "fetch_p99_ms": 1e3 * c.percentile(fetch_s, 99) if fetch_s else None,
    }


def worker_main(argv: list[str]) -> int:
    """``--worker PORT BYTES SHM``: a parameter fetcher. Says ``ready PATH``, then answers
    each command line with ``result JSON``: ``time N VERSION DIGEST`` (timed fetches),
    ``blast PORT N`` (the loopback reference), ``loop MODE END`` (fetch until END); ends
    at end of input."""
    port, size, shm = int(argv[0]), int(argv[1]), argv[2] == "1"
    c.start_watchdog(WORKER_WATCHDOG_S, "params worker")
    client = TcpClient(
        HOST,
        port,
        sample_example(),
        params_example=pytree(size),
        shared_memory=shm,
        connect_timeout=CALL_S,
    )
    _say(f"ready {client.transport_path}")
    for _ in range(MAX_LOOPS):
        words = sys.stdin.readline().split()
        if not words:
            break
        report: dict[str, Any] = {"error": None}
        try:
            if words[0] == "time":
                report.update(_timed_fetches(client, int(words[1]), int(words[2]), words[3]))
            elif words[0] == "blast":
                report.update(_blast(int(words[1]), int(words[2]), nbytes(pytree(size))))
            elif words[0] == "loop":
                report.update(_fetch_loop(client, words[1], float(words[2])))
            else:
                report["error"] = f"unknown command {words[0]!r}"
        except Exception as e:  # noqa: BLE001 - reported to the learner
            report["error"] = f"{type(e).__name__}: {e}"
        _say("result " + json.dumps(report))
    client.close(timeout=5.0)
    return 0


def feeder_main(argv: list[str]) -> int:
    """``--feeder PORT WID``: sends small samples (``meta`` = (WID, seq), every ``obs``
    element seq mod 1000) as fast as the server takes them, from ``go START END`` until
    ``stop`` (or the end of input, or END); then closes (flushing) and says ``result
    JSON``."""
    port, wid = int(argv[0]), int(argv[1])
    c.start_watchdog(WORKER_WATCHDOG_S, f"params feeder {wid}")
    tree = sample_example()
    client = TcpClient(HOST, port, tree, shared_memory=False, connect_timeout=CALL_S)
    _say("ready")
    words = sys.stdin.readline().split()
    if words[:1] != ["go"]:
        client.close(timeout=1.0)
        return 1
    start, end = float(words[1]), float(words[2])
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    time.sleep(max(0.0, start - time.monotonic()))
    report: dict[str, Any] = {"wid": wid, "error": None}
    seq = 0
    try:
        for _ in range(MAX_LOOPS):
            if stop.is_set() or time.monotonic() >= end:
                break
            tree["meta"][:] = (wid, seq)
            tree["obs"]["a"][:] = seq % 1000
            tree["obs"]["b"][:] = seq % 1000
            client.send(tree, timeout=CALL_S)
            seq += 1
        report["flushed"] = client.close(timeout=CALL_S)
    except Exception as e:  # noqa: BLE001 - reported to the learner
        report["error"] = f"{type(e).__name__}: {e}"
        client.close(timeout=1.0)
    report["sent"] = seq
    _say("result " + json.dumps(report))
    return 0


def raise_nofile() -> int:
    """Raises this process's open-files limit (``RLIMIT_NOFILE``) to its hard limit, for a
    thousand connections; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def renice(nice: int) -> int:
    """Sets every thread of this process (on Linux niceness is per thread; threads started
    later inherit their starter's) to ``nice``; returns the calling thread's niceness now."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    return os.getpriority(os.PRIO_PROCESS, 0)


def _crowd_fetcher(client: TcpClient, start: float, end: float, out: dict[str, Any]) -> None:
    """One connection of the crowd: fetches back to back (``min_version`` the newest it has,
    so each call returns at once with the latest version) from ``start`` until ``end``
    (monotonic), each call given until ``end + CROWD_GRACE_S``. Each copy's stamps are
    checked and its versions must never go back; ``out`` gets the counts."""
    fetch_s: list[float] = []
    fetches = late = torn = torn_copies = timeouts = backwards = last = 0
    first: float | None = None
    error: str | None = None
    time.sleep(max(0.0, start - time.monotonic()))
    for _ in range(MAX_LOOPS):
        now = time.monotonic()
        if now >= end:
            break
        t = time.perf_counter()
        try:
            version, tree = client.params(
                min_version=max(last, 1), timeout=end + CROWD_GRACE_S - now
            )
        except TimeoutError:
            timeouts += 1
            continue
        except Exception as e:  # noqa: BLE001 - reported to the learner
            error = f"{type(e).__name__}: {e}"
            break
        done = time.monotonic()
        bad = torn_leaves(tree, version)
        torn += bad
        torn_copies += bad > 0
        backwards += version < last
        last = max(last, version)
        if done > end:
            late += 1  # completed after the phase: checked, not counted in it
            continue
        fetches += 1
        fetch_s.append(time.perf_counter() - t)
        if first is None:
            first = done - start
    out.update(
        fetches=fetches,
        late=late,
        torn_leaves=torn,
        torn_copies=torn_copies,
        timeouts=timeouts,
        backwards=backwards,
        last_version=last,
        first_fetch_s=first,
        fetch_ms=[round(1e3 * x, 3) for x in fetch_s],
        error=error,
    )


def _crowd_loop(clients: list[TcpClient], start: float, end: float) -> dict[str, Any]:
    """Every client of ``clients`` fetching in a thread of its own from ``start`` to ``end``;
    the per-client counts, in client order, and their sums."""
    outs: list[dict[str, Any]] = [{} for _ in clients]
    threads = [
        threading.Thread(target=_crowd_fetcher, args=(cl, start, end, out), daemon=True)
        for cl, out in zip(clients, outs, strict=True)
    ]
    for th in threads:
        th.start()
    deadline = end + CROWD_GRACE_S + 10.0
    for th in threads:
        th.join(timeout=max(0.0, deadline - time.monotonic()))
    stuck = sum(th.is_alive() for th in threads)
    done = [o for o in outs if o]
    errors = [o["error"] for o in done if o["error"]]
    return {
        "clients": len(clients),
        "stuck_threads": stuck,
        "fetches": [int(o.get("fetches", 0)) for o in outs],
        "first_fetch_s": [o.get("first_fetch_s") for o in outs],
        "fetch_ms": [x for o in done for x in o["fetch_ms"]],
        "late": sum(int(o["late"]) for o in done),
        "timeouts": sum(int(o["timeouts"]) for o in done),
        "torn_leaves": sum(int(o["torn_leaves"]) for o in done),
        "torn_copies": sum(int(o["torn_copies"]) for o in done),
        "backwards": sum(int(o["backwards"]) for o in done),
        "last_version": max((int(o["last_version"]) for o in done), default=0),
        "error_count": len(errors),
        "errors": errors[:5],
    }


def crowd_main(argv: list[str]) -> int:
    """``--crowd PORT BYTES N``: N parameter fetchers in this process (one ``TcpClient`` with
    ``params_example`` each, over TCP). Says ``ready CONNECTED FIRST_ERROR``, then answers
    each ``loop START END`` (every connection fetching back to back in a thread of its own)
    with ``result JSON``; ``loop START END NICE`` runs the loop at niceness NICE (``renice``:
    only up, where unprivileged). Closes the connections at end of input."""
    port, size, n = int(argv[0]), int(argv[1]), int(argv[2])
    c.start_watchdog(WORKER_WATCHDOG_S, "params crowd")
    raise_nofile()
    example, params_example = sample_example(), pytree(size)
    clients: list[TcpClient] = []
    first_error = ""
    for _ in range(n):
        try:
            clients.append(
                TcpClient(
                    HOST,
                    port,
                    example,
                    params_example=params_example,
                    shared_memory=False,
                    connect_timeout=CALL_S,
                )
            )
        except Exception as e:  # noqa: BLE001 - reported to the learner
            first_error = first_error or f"{type(e).__name__}: {e}"
    _say(f"ready {len(clients)} {json.dumps(first_error)}")
    for _ in range(MAX_LOOPS):
        words = sys.stdin.readline().split()
        if not words:
            break
        report: dict[str, Any] = {"error": None, "connected": len(clients)}
        try:
            if words[0] == "loop":
                if len(words) > 3:
                    report["nice"] = renice(int(words[3]))
                report.update(_crowd_loop(clients, float(words[1]), float(words[2])))
            else:
                report["error"] = f"unknown command {words[0]!r}"
        except Exception as e:  # noqa: BLE001 - reported to the learner
            report["error"] = f"{type(e).__name__}: {e}"
        _say("result " + json.dumps(report))
    for client in clients:
        client.close(timeout=5.0)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "--feeder":
        sys.exit(feeder_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "--crowd":
        sys.exit(crowd_main(sys.argv[2:]))
