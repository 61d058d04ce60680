"""echo across real network interfaces: a learner host and worker hosts, each a Linux network
namespace with its own interface and address (`testkit.netns`), and the faults of a real
network between them.

This machine's kernel has neither netem nor tbf, so faults come from two places: the links
themselves (`ip link set down/up`: a partition that heals, packets dropped without a reset),
and `_proxy.py`, a userspace relay on the learner host in front of some workers (latency, a
bandwidth cap, stalls, resets, half-open connections).

What must hold, and is asserted:
- every worker's samples reach the learner exactly once, in order (the learner keeps running);
  after a learner restart, exactly the samples the old learner had not acknowledged reach the
  new one, once each;
- the learner's memory stays bounded;
- no call blocks past its timeout (every worker call has one, and every worker reports);
- a worker resumes within `RESUME_S` of a partition healing, and a half-open connection is
  detected within the heartbeat timeout (plus `SLACK_S`).

Each test prints what it measured (`-s`); `docs/guides/tcp.md` ("Across real networks")
tabulates it. The seeded soak runs `ECHO_MULTIHOST_SOAK_S` seconds (8 by default;
`just soak-multihost` runs it longer). Skipped without root and `ip`.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import test_durable as _durable
import test_wire_v2 as _wire_v2
from compressing import make
from conftest import poll
from test_wire_v2 import PROXY, Child
from testkit import netns

from echo.checkpoint import periodic_checkpoints

REASON = netns.skip_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

#: The child-process fixture of the wire v2 tests: `children(name, argv)`.
children = _wire_v2.children

#: Heartbeat timeout of both sides (the client's and the learner's `TcpTransport`'s).
HEARTBEAT_S = 2.0
#: How late a detection may be past the heartbeat timeout (a heartbeat is sent every third
#: of it; the check runs on the next read or heartbeat).
SLACK_S = 3.0
#: How soon after a partition heals every worker behind it acknowledges samples again: a
#: reconnect backs off up to 1 s between attempts, and the handshake then takes a round trip.
RESUME_S = 6.0
#: Samples' ids are worker * STRIDE + sequence number (exact as the float32 obs that repeats
#: them, below 2**24, for up to 16 workers).
STRIDE = 1_000_000
#: The seeded soak's length and schedule.
SOAK_S = float(os.environ.get("ECHO_MULTIHOST_SOAK_S", "8"))
SOAK_SEED = int(os.environ.get("ECHO_MULTIHOST_SOAK_SEED", "20261206"))
#: No child outlives a broken test for long.
ALARM_S = int(SOAK_S) + 260

LEARNER = textwrap.dedent(
    """
    import json, signal, sys, threading, time
    import numpy as np
    import echo

    port, heartbeat, alarm = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    signal.alarm(alarm)
    EXAMPLE = {"id": np.zeros((), np.int64), "obs": np.zeros((3,), np.float32)}

    def rss_kib():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))

    server = echo.Server(EXAMPLE, 1, num_buffers=4, producer_queue_size=64,
                         transport=echo.TcpTransport(port=port, host="0.0.0.0",
                                                     heartbeat_timeout=heartbeat))
    listening = time.monotonic()
    server.start()
    print("port", server.port, repr(listening), rss_kib(), flush=True)

    def commands():
        for line in sys.stdin:
            word = line.strip()
            if word == "drain":
                server.close(drain=True)
                return
            if word == "stats":
                stats = server.stats().as_dict()
                ints = {k: v for k, v in stats.items() if isinstance(v, int)}
                print("stats", json.dumps(ints), rss_kib(), flush=True)

    threading.Thread(target=commands, daemon=True).start()
    out = []
    for _ in range(10**8):
        sample = server.sample(timeout=250)
        if sample is None:
            break
        i = int(sample.batch["id"][0])
        intact = bool((sample.batch["obs"][0] == np.float32(i)).all())
        out.append(f"id {i} {int(intact)}")
        if len(out) >= 64:
            sys.stdout.write("\\n".join(out) + "\\n")
            sys.stdout.flush()
            out.clear()
    if out:
        sys.stdout.write("\\n".join(out) + "\\n")
    stats = server.stats().as_dict()
    print("stats", json.dumps({k: v for k, v in stats.items() if isinstance(v, int)}),
          rss_kib(), flush=True)
    print("done", flush=True)
    """
)


@pytest.fixture
def hosts() -> Iterator[Callable[[int], netns.Hosts]]:
    made: list[netns.Hosts] = []

    def make(workers: int) -> netns.Hosts:
        made.append(netns.Hosts(workers))
        return made[-1]

    yield make
    for bed in made:
        bed.close()


def _learner(
    children: Callable[..., Child], bed: netns.Hosts, name: str = "learner", port: int = 0
) -> tuple[Child, int, float, int]:
    """A learner on the learner host: the child, its port, when it listened, its RSS (KiB)."""
    argv = [sys.executable, "-c", LEARNER, str(port), str(HEARTBEAT_S), str(ALARM_S)]
    child = children(name, bed.learner.run(argv), stdin=True)
    _, got, listening, rss = child.expect("port ").split()
    return child, int(got), float(listening), int(rss)


def _proxy(children: Callable[..., Child], bed: netns.Hosts, k: int, port: int, *args: str) -> Any:
    """A fault proxy on the learner host, on worker host `k`'s link, in front of the learner
    (over the learner host's own loopback): its child and the port workers connect to."""
    argv = [
        sys.executable,
        str(PROXY),
        "--listen-host",
        bed.learner_addresses[k],
        "--target-port",
        str(port),
        *args,
    ]
    child = children(f"proxy{k}", bed.learner.run(argv), stdin=True)
    return child, int(child.expect("port ").split()[1])


def _command(proxy: Child, line: str) -> str:
    proxy.send_line(line)
    return proxy.expect("ok ")


def _workers(
    children: Callable[..., Child],
    bed: netns.Hosts,
    per_host: int,
    n: int,
    ports: dict[int, int],
    pace: float,
) -> list[Child]:
    """`per_host` workers on every worker host; host `k`'s connect to the learner's address on
    its link, at `ports[k]` (the learner's port, or a proxy's)."""
    out = []
    for k, host in enumerate(bed.workers):
        for j in range(per_host):
            w = k * per_host + j
            argv = [
                sys.executable,
                "-c",
                _wire_v2.WORKER,
                str(ports[k]),
                str(w),
                str(n),
                "8",  # acknowledgements in flight
                "false",  # shared memory: another host has none to offer anyway
                bed.learner_addresses[k],
                str(pace),
                str(HEARTBEAT_S),
                str(STRIDE),
                str(ALARM_S),
            ]
            out.append(children(f"worker{w}", host.run(argv)))
    return out


def _results(workers: list[Child], timeout: float) -> list[dict[str, Any]]:
    """Each worker's result (no error, everything flushed), which crossed the hosts' links:
    never shared memory."""
    results = _wire_v2._results(workers, timeout)
    for result in results:
        assert result["path"] == "tcp", result
    return results


_ids = _wire_v2._learner_ids


def _per_worker(ids: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i in ids:
        out.setdefault(i // STRIDE, []).append(i % STRIDE)
    return out


def _drain(learner: Child) -> tuple[dict[str, int], int]:
    """Closes the learner with a drain; its final counters and RSS (KiB)."""
    learner.send_line("drain")
    learner.expect("done", 60)
    line = next(ln for ln in reversed(learner.lines) if ln.startswith("stats "))
    return _stats_line(line)


def _stats_line(line: str) -> tuple[dict[str, int], int]:
    """A learner's `stats {json} RSS` line."""
    payload, rss = line.split(" ", 1)[1].rsplit(" ", 1)
    return json.loads(payload), int(rss)


def _states(worker: Child) -> list[tuple[float, int, int, int]]:
    worker.drain()
    out = []
    for line in worker.lines:
        if line.startswith("s "):
            _, t, r, a, s = line.split()
            out.append((float(t), int(r), int(a), int(s)))
    return out


def _acked_at(worker: Child, when: float) -> int:
    before = [s for s in _states(worker) if s[0] <= when]
    return before[-1][2] if before else 0


def _first_progress_after(worker: Child, when: float, deadline: float) -> float | None:
    """When `worker` first had more acknowledged than at `when` (None: not by `deadline`)."""
    base = _acked_at(worker, when)
    for _ in range(100_000):
        later = [s for s in _states(worker) if s[0] > when and s[2] > base]
        if later:
            return later[0][0]
        if any(ln.startswith("result ") for ln in worker.lines) or time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return None


def _wait_for(learner: Child, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    for _ in range(1_000_000):
        learner.drain()
        if len(_ids(learner)) >= count:
            return
        assert time.monotonic() < deadline, f"the learner got {len(_ids(learner))} of {count}"
        time.sleep(0.02)


def _exactly_once(learner: Child, num_workers: int, n: int) -> None:
    got = _per_worker(_ids(learner))
    for w in range(num_workers):
        seqs = got.get(w, [])
        assert seqs == list(range(n)), (
            f"worker {w}: {len(seqs)} samples, first gaps or repeats near "
            f"{next((i for i, s in enumerate(seqs) if s != i), None)}"
        )


@pytest.mark.timeout(240)
def test_sixteen_workers_on_four_hosts_deliver_exactly_once_through_a_slow_link_and_a_partition(
    children: Callable[..., Child], hosts: Callable[[int], netns.Hosts]
) -> None:
    """16 workers, 4 per host. Host 1 reaches the learner through a proxy adding 20 ms each
    way and capping each connection at 1 MB/s; host 2 is partitioned (its link down) for
    twice the heartbeat timeout part-way, then heals. Every sample arrives exactly once, in
    order; host 2's workers resume within RESUME_S of the heal; the learner's memory stays
    bounded."""
    bed = hosts(4)
    learner, port, _, rss_start = _learner(children, bed)
    _, slow_port = _proxy(children, bed, 1, port, "--latency-ms", "20", "--rate", "1000000")
    per_host, n = 4, 1500
    ports = {0: port, 1: slow_port, 2: port, 3: port}
    workers = _workers(children, bed, per_host, n, ports, pace=0.002)
    total = per_host * len(bed.workers) * n
    _wait_for(learner, total // 4)
    bed.partition(2)
    time.sleep(2 * HEARTBEAT_S)
    bed.heal(2)
    healed = time.monotonic()
    behind = workers[2 * per_host : 3 * per_host]
    resumed = [_first_progress_after(w, healed, healed + 30) for w in behind]
    results = _results(workers, 120)
    stats, rss_end = _drain(learner)
    _exactly_once(learner, len(workers), n)
    waits = [None if t is None else t - healed for t in resumed]
    print(f"resumed after the heal in {waits} s; learner RSS {rss_start} -> {rss_end} KiB")
    # A worker that had sent everything before the heal has nothing to resume.
    host2 = results[2 * per_host : 3 * per_host]
    for w, (wait, result) in enumerate(zip(waits, host2, strict=True)):
        if wait is None:
            assert result["acked"] == n, f"host 2 worker {w} did not resume: {result}"
        else:
            assert wait < RESUME_S, f"host 2 worker {w} resumed {wait:.1f} s after the heal"
    assert any(r["reconnects"] >= 1 for r in host2), host2
    # Host 2's reconnects came back as connections of their own, and resumed their sessions.
    assert stats["v2_connections_total"] > len(workers), stats
    assert stats["sessions_resumed_total"] >= 1, stats
    assert rss_end - rss_start < 200 * 1024, (rss_start, rss_end)


@pytest.mark.timeout(120)
def test_a_half_open_connection_is_detected_on_both_sides_within_the_heartbeat_timeout(
    children: Callable[..., Child], hosts: Callable[[int], netns.Hosts]
) -> None:
    """The proxy stalls every connection: sockets stay open, nothing passes either way (a
    peer that vanished without a reset). The worker takes its connection for dead within the
    heartbeat timeout and reconnects (new connections pass); the learner drops the stalled
    one within its own. Nothing is lost or repeated."""
    bed = hosts(1)
    learner, port, _, _ = _learner(children, bed)
    proxy, proxy_port = _proxy(children, bed, 0, port)
    n = 3000
    workers = _workers(children, bed, 2, n, {0: proxy_port}, pace=0.001)
    _wait_for(learner, 400)
    stalled = time.monotonic()
    _command(proxy, "stall")
    reconnected = []
    for worker in workers:
        t = None
        for _ in range(100_000):
            t = next((s[0] for s in _states(worker) if s[0] > stalled and s[1] >= 1), None)
            if t is not None or time.monotonic() > stalled + 30:
                break
            time.sleep(0.05)
        assert t is not None, f"{worker.name} never took its stalled connection for dead"
        reconnected.append(t - stalled)
    # The learner: both stalled connections gone, the two new ones open.
    for _ in range(100_000):
        learner.send_line("stats")
        active = _stats_line(learner.expect("stats "))[0]["active_connections"]
        if active <= 2 or time.monotonic() > stalled + 30:
            break
        time.sleep(0.2)
    server_side = time.monotonic() - stalled
    _results(workers, 120)
    _drain(learner)
    _exactly_once(learner, len(workers), n)
    print(f"client detected in {reconnected} s; the learner in <= {server_side:.1f} s")
    assert max(reconnected) < HEARTBEAT_S + SLACK_S, reconnected
    assert active <= 2, active
    assert server_side < HEARTBEAT_S + SLACK_S, server_side


@pytest.mark.timeout(240)
def test_a_learner_restarted_on_its_host_gets_every_unacknowledged_sample_once(
    children: Callable[..., Child], hosts: Callable[[int], netns.Hosts]
) -> None:
    """8 workers on 2 hosts; the learner is SIGKILLed part-way and a new one starts on the
    same address. Each worker's samples from what the old learner acknowledged on reach the
    new one exactly once, in order; the old learner got a prefix of each worker's samples.
    (Samples it acknowledged but had not handed out are lost: the documented cost of a crash
    without durable acknowledgements.)"""
    bed = hosts(2)
    old, port, _, _ = _learner(children, bed, "learner-old")
    per_host, n = 4, 1500
    workers = _workers(children, bed, per_host, n, {0: port, 1: port}, pace=0.002)
    _wait_for(old, 2000)
    old.kill()
    old.read_to_eof()
    killed = time.monotonic()
    # Every worker reports after the kill before the new learner starts: its last report is
    # what the old learner acknowledged.
    deadline = killed + 30
    for worker in workers:
        for _ in range(100_000):
            if any(s[0] > killed for s in _states(worker)) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    time.sleep(0.3)
    new, new_port, listening, _ = _learner(children, bed, "learner-new", port)
    assert new_port == port
    results = _results(workers, 120)
    _drain(new)
    old_got, new_got = _per_worker(_ids(old)), _per_worker(_ids(new))
    lost = 0
    for w, (worker, result) in enumerate(zip(workers, results, strict=True)):
        before = old_got.get(w, [])
        assert before == list(range(len(before))), f"worker {w}: the old learner's out of order"
        acked = _acked_at(worker, listening)
        assert new_got.get(w, []) == list(range(acked, n)), (
            f"worker {w}: the new learner got {len(new_got.get(w, []))}, expected {acked}..{n}"
        )
        assert acked >= len(before), (w, acked, len(before))
        lost += acked - len(before)
        assert result["acked"] == n
    print(f"{lost} samples acknowledged by the killed learner but never handed out")


@pytest.mark.timeout(240)
def test_a_learner_killed_and_restored_loses_nothing_of_its_durable_workers_across_hosts(
    children: Callable[..., Child], hosts: Callable[[int], netns.Hosts], tmp_path: Path
) -> None:
    """4 durable workers on 2 hosts send 1,500 samples each across the links to a learner
    checkpointing every 0.1 s; it is SIGKILLed part-way and restored from its latest
    checkpoint on the same address: it then holds every sample of every worker exactly once."""
    bed = hosts(2)
    directory = tmp_path / "ckpt"
    argv = [sys.executable, "-c", _durable.LEARNER, "fifo"]
    first = [*argv, "0", str(directory), "0", "0.0.0.0"]
    old = children("learner-old", bed.learner.run(first), stdin=True)  # hands nothing out
    # The learner runs as root in its namespace; the checkpoints are this test's files.
    port = int(old.expect("port ").split()[1])
    per_host, n = 2, 1500
    workers = []
    for k, host in enumerate(bed.workers):
        for j in range(per_host):
            w = k * per_host + j
            args = [str(port), str(w), str(n), "16384", "tcp", bed.learner_addresses[k]]
            worker = children(
                f"worker{w}", host.run([sys.executable, "-c", _durable.WORKER, *args])
            )
            workers.append(worker)
    for worker in workers:
        assert worker.expect("connected").split()[1] == "tcp"
    time.sleep(random.Random(SOAK_SEED).uniform(0.3, 0.8))
    poll(lambda: periodic_checkpoints(directory), bool, "a first checkpoint")
    killed_at = time.time()
    old.kill()
    restore = [*argv, str(port), str(directory), "1", "0.0.0.0"]
    new = children("learner-new", bed.learner.run(restore), stdin=True)
    restored = new.expect("restored")
    assert int(new.expect("port ").split()[1]) == port
    results = [json.loads(w.expect("result ", 120).split(" ", 1)[1]) for w in workers]
    new.send_line("dump")
    got = _per_worker(_durable.dumped_ids(new))
    for w, result in enumerate(results):
        seqs = sorted(got.get(w, []))
        assert seqs == list(range(n)), (w, len(seqs), seqs[:3], restored, results)
        assert result["closed"], result
    _durable.assert_cut_off(results, killed_at)


@pytest.mark.timeout(int(SOAK_S) + 300)
def test_a_seeded_soak_of_random_faults_keeps_every_sample_exactly_once(
    children: Callable[..., Child], hosts: Callable[[int], netns.Hosts]
) -> None:
    """Two hosts of 4 workers each, every worker behind its host's fault proxy. For
    ECHO_MULTIHOST_SOAK_S seconds a seeded schedule draws a fault every 0.5-2.5 s: a
    partition of a host (0.5-3 s), resets of a host's connections, a stall of them that heals
    (0.5-4 s: past the heartbeat timeout they are taken for dead), or a new latency (0-40 ms)
    and bandwidth cap. Then the workers finish: every sample arrives exactly once, in order,
    and the learner's memory stays bounded."""
    seconds, seed = SOAK_S, SOAK_SEED
    rng = random.Random(seed)
    bed = hosts(2)
    learner, port, _, rss_start = _learner(children, bed)
    proxies = [_proxy(children, bed, k, port) for k in range(2)]
    per_host = 4
    n = max(1500, int(seconds * 450))  # sending for about as long as the faults come
    ports = {k: p for k, (_, p) in enumerate(proxies)}
    workers = _workers(children, bed, per_host, n, ports, pace=0.002)
    end = time.monotonic() + seconds
    faults: list[str] = []
    for _ in range(100_000):
        if time.monotonic() >= end:
            break
        time.sleep(rng.uniform(0.5, 2.5))
        k = rng.randrange(2)
        proxy = proxies[k][0]
        kind = rng.choice(["partition", "reset", "stall", "slow"])
        if kind == "partition":
            hold = rng.uniform(0.5, 3.0)
            bed.partition(k)
            time.sleep(hold)
            bed.heal(k)
            faults.append(f"partition {k} {hold:.1f}s")
        elif kind == "reset":
            _command(proxy, "drop")
            faults.append(f"reset {k}")
        elif kind == "stall":
            hold = rng.uniform(0.5, 4.0)
            _command(proxy, "stall")
            time.sleep(hold)
            _command(proxy, "resume")
            faults.append(f"stall {k} {hold:.1f}s")
        else:
            latency, rate = rng.choice([0, 5, 20, 40]), rng.choice([0, 250_000, 2_000_000])
            _command(proxy, f"latency {latency}")
            _command(proxy, f"rate {rate}")
            faults.append(f"slow {k} {latency}ms {rate}B/s")
    for proxy, _ in proxies:
        _command(proxy, "latency 0")
        _command(proxy, "rate 0")
        _command(proxy, "resume")
    for k in range(2):
        bed.heal(k)
    results = _results(workers, 240)
    stats, rss_end = _drain(learner)
    _exactly_once(learner, len(workers), n)
    reconnects = sum(r["reconnects"] for r in results)
    print(
        f"seed {seed}, {seconds:g} s, {len(faults)} faults ({'; '.join(faults)}); "
        f"{reconnects} reconnects, {sum(r['resent'] for r in results)} resent, "
        f"{stats['samples_deduplicated_total']} deduplicated; RSS {rss_start} -> {rss_end} KiB"
    )
    assert rss_end - rss_start < 200 * 1024, (rss_start, rss_end)


def test_the_hosts_are_apart() -> None:
    """The test bed itself: two worker hosts reach the learner host only over their own
    links, not each other, and a partitioned host reaches nothing."""

    with netns.Hosts(2) as bed:
        probe = (
            "import socket, sys\n"
            "s = socket.socket(); s.settimeout(1.0)\n"
            "try:\n    s.connect((sys.argv[1], 9)); print('open')\n"
            "except ConnectionRefusedError: print('reached')\n"
            "except OSError as e: print('unreachable', type(e).__name__)\n"
        )

        def reach(k: int, address: str) -> str:
            argv = bed.workers[k].run([sys.executable, "-c", probe, address])
            return subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout.strip()

        assert reach(0, bed.learner_addresses[0]) == "reached"  # a refused port: reachable
        assert reach(0, bed.workers[1].address).startswith("unreachable")
        assert reach(0, "127.0.0.1").startswith("unreachable")  # no loopback on a worker host
        bed.partition(0)
        assert reach(0, bed.learner_addresses[0]).startswith("unreachable")
        bed.heal(0)
        assert reach(0, bed.learner_addresses[0]) == "reached"
    assert not Path(f"/run/netns/{bed.learner_ns}").exists()


COMPRESSING_LEARNER = textwrap.dedent(
    """
    import json, signal, sys
    import numpy as np
    import echo
    from compressing import example, make, COMPRESS

    kind, n, alarm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    signal.alarm(alarm)
    server = echo.Server(example(kind), 4, compress=COMPRESS,
                         transport=echo.TcpTransport(port=0, host="0.0.0.0"))
    server.start()
    print("port", server.port, flush=True)
    seen = []
    while len(seen) < n:
        sample = server.sample(timeout=30)
        assert sample is not None, f"{len(seen)} of {n} samples"
        batch = sample.batch
        for k, i in enumerate(batch["id"].tolist()):
            if kind == "ragged":
                cu = batch["tokens"].cu_seqlens
                tokens = batch["tokens"].values[cu[k]:cu[k + 1]]
            else:
                tokens = batch["tokens"][k]
            assert np.array_equal(tokens, make(kind, i)["tokens"]), i
            seen.append(i)
    stats = server.stats()
    print("stats", json.dumps([sorted(seen) == list(range(n)),
                               stats.samples_received_compressed_total,
                               stats.compressed_bytes_received_total]), flush=True)
    server.close()
    """
)

COMPRESSING_WORKER = textwrap.dedent(
    """
    import signal, sys
    import echo
    from compressing import example, make

    kind, address = sys.argv[1], sys.argv[2]
    port, n, alarm = (int(a) for a in sys.argv[3:6])
    signal.alarm(alarm)
    client = echo.TcpClient(address, port, example(kind))  # shared memory: the default
    print("leaves", sorted(client.wire_compression_leaves), flush=True)
    for i in range(n):
        client.send(make(kind, i), timeout=30)
    client.wait(timeout=30)
    client.close()
    print("sent", flush=True)
    """
)


@pytest.mark.parametrize("kind", ["fixed", "ragged"])
def test_a_worker_on_another_host_compresses_what_the_learner_asks_by_default(
    hosts: Callable[[int], netns.Hosts], children: Callable[..., Child], kind: str
) -> None:
    """A worker with the default `shared_memory` asks for shared memory, is not offered it
    (another host), and so compresses the leaves the learner's `compress=` names: every
    sample arrives compressed, and intact."""
    bed = hosts(1)
    n = 200
    here = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
    learner = children(
        "learner",
        bed.learner.run([sys.executable, "-c", COMPRESSING_LEARNER, kind, str(n), "120"]),
        env=env,
    )
    port = int(learner.expect("port ").split()[1])
    argv = [sys.executable, "-c", COMPRESSING_WORKER, kind, bed.learner_addresses[0]]
    worker = children("worker", bed.workers[0].run([*argv, str(port), str(n), "120"]), env=env)
    assert worker.expect("leaves ") == "leaves ['tokens']"
    worker.expect("sent")
    exact, compressed, wire_bytes = json.loads(learner.expect("stats ").split(" ", 1)[1])
    assert exact, "every sample once"
    assert compressed == n
    raw = sum(make(kind, i)["tokens"].nbytes for i in range(n))
    assert 0 < wire_bytes < raw / 4, (wire_bytes, raw)
