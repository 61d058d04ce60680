"""In-process throughput and latency benchmark for any installed ``echo``.

The script uses only the in-process API that both our ``echo`` and the published
``id-echo`` 0.2.1 provide: ``Server(example, batch_size=...)``, ``submit(pytree)``,
``sample() -> Sample(batch, info) | None`` and ``close()``. It never calls ``start()``:
without a transport there is nothing to bind (0.2.1 raises ``RuntimeError`` there), and
``submit()`` needs no ``start()`` in either implementation. No network, threads only.

Scenarios (pytree, batch size):

* ``small``: ``{"obs": f32[4], "reward": f32[1]}``, 20 B per sample, batch_size 32.
* ``large``: 40 leaves ``f32[1280]`` (5120 B each, 204.8 KB per sample), batch_size 64.

Each scenario measures:

1. ``memcpy``: the physical reference. Single-thread ``np.copyto`` of one batch's payload,
   one contiguous copy per leaf (the ring's layout), from one source batch into three
   rotating preallocated destination batches (like a three-buffer ring); for the tiny
   ``small`` batch (640 B) this is dominated by numpy's per-call cost, not bandwidth. Also
   ``rowcopy``: the naive Python stacking loop (``np.copyto`` per sample and leaf into
   preallocated batch rows), for context.
2. ``throughput``: one producer thread calls ``submit()`` N times while the main thread
   calls ``sample()`` N / batch_size times. Samples come round-robin from a small pool built
   before timing; the only per-sample Python work besides ``submit()`` is writing the
   sample id into element 0 of leaf 0 (an exact integer in float32, ids < 2**24). Pool
   entries are rewritten once ``submit()`` returns, so a ``submit()`` that kept a reference
   instead of copying would show up as ``correct: false``. The
   consumer touches every byte of every leaf of every batch with
   ``np.bitwise_or.reduce`` over a ``uint64`` view (``uint8`` if the leaf's size is not a
   multiple of 8), which runs at tens of GB/s in cache, and checks that the ids it sees are
   exactly the submitted ones, each exactly once (``correct``) and whether they came in
   FIFO order (``in_order``). Reported: samples/s, payload GB/s (1e9 B/s) and that GB/s as
   a fraction of the memcpy reference, plus the consumer's time split (blocked in
   ``sample()``, touching, verifying).
3. ``sample_overhead``: the cost of ``sample()`` alone when the batch is already complete.
   The main thread submits one batch (untimed), drops the previous Sample, then times only
   ``server.sample()`` with ``time.perf_counter_ns()``; median, p99, mean in microseconds.

Every loop is bounded in count and in time: each phase stops submitting after ``--seconds``
(default 20 s; the run is then marked ``truncated`` and ends with a batch of id -1 markers);
a phase still running 10 s later has its server closed (a lost sample would otherwise block
``sample()`` forever; the run is then ``correct: false``), and a watchdog ends the process
after ``--max-seconds`` (default 300 s). The server is always closed.

Compare two implementations (one run each, same machine, ratios from one run)::

    python -m benches.suites.core_inprocess --json a.json --label ours
    /work/venvs/peer/bin/python -m benches.suites.core_inprocess --json b.json --label id-echo-0.2.1
    python -m benches.compare a.json b.json

``--quick`` runs a couple of seconds in total (smoke test); ``--only small`` or
``--only large`` selects one scenario. Run on an otherwise idle machine (the JSON records
the load average before and after). Depends on numpy, echo and the standard library only.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import echo
from benches import common as h
from echo import Server

ID_LIMIT = 2**24  # float32 represents every integer below this exactly
POOL_SIZE = 16  # distinct pre-built sample pytrees the producer cycles through
END_MARKER = -1.0  # id written into samples that pad a truncated run to a batch boundary
CLOSE_GRACE_S = 10.0  # a phase still running this long after --seconds gets close()d


@dataclass(frozen=True)
class Scenario:
    name: str
    batch_size: int
    keys: tuple[str, ...]  # dict keys of the pytree; leaf 0 carries the sample id
    shapes: tuple[tuple[int, ...], ...]
    n_samples: int  # throughput run, default
    n_samples_quick: int
    n_overhead: int  # timed sample() calls in the overhead run, default
    n_overhead_quick: int

    def example(self) -> dict[str, np.ndarray]:
        return {k: np.zeros(s, np.float32) for k, s in zip(self.keys, self.shapes, strict=True)}

    @property
    def sample_bytes(self) -> int:
        return sum(int(np.prod(s)) * 4 for s in self.shapes)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        name="small",
        batch_size=32,
        keys=("obs", "reward"),
        shapes=((4,), (1,)),
        n_samples=32 * 25_000,
        n_samples_quick=32 * 2_000,
        n_overhead=2_000,
        n_overhead_quick=200,
    ),
    Scenario(
        name="large",
        batch_size=64,
        keys=tuple(f"f{i:02d}" for i in range(40)),
        shapes=((1280,),) * 40,
        n_samples=64 * 800,
        n_samples_quick=64 * 20,
        n_overhead=150,
        n_overhead_quick=20,
    ),
)


# --------------------------------------------------------------------------- helpers


def _touch_fn(shape: tuple[int, ...]) -> Callable[[np.ndarray], object]:
    """A cheap function that reads every byte of an array of ``shape`` (float32, batched)."""
    nbytes = int(np.prod(shape)) * 4
    wide = np.uint64 if nbytes % 8 == 0 else np.uint8
    reduce = np.bitwise_or.reduce

    def touch(leaf: np.ndarray) -> object:
        return reduce(leaf.reshape(-1).view(wide))

    return touch


def _percentile_us(ns: np.ndarray, q: float) -> float:
    return float(np.percentile(ns, q)) / 1e3


# --------------------------------------------------------------------------- memcpy reference


def bench_memcpy(sc: Scenario, seconds: float) -> dict[str, Any]:
    """Bulk per-leaf batch copy (physical reference) and naive per-sample row copy."""
    bs = sc.batch_size
    rng = np.random.default_rng(0)
    src = [rng.random((bs, *s), dtype=np.float32) for s in sc.shapes]
    dst = [[np.empty((bs, *s), np.float32) for s in sc.shapes] for _ in range(3)]
    batch_bytes = bs * sc.sample_bytes
    copyto = np.copyto

    for d in dst:  # fault the pages in before timing
        for a, b in zip(d, src, strict=True):
            copyto(a, b)

    max_reps = 1_000_000
    reps = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while reps < max_reps:
        d = dst[reps % 3]
        for a, b in zip(d, src, strict=True):
            copyto(a, b)
        reps += 1
        if (reps & 15) == 0 and time.perf_counter() > deadline:
            break
    bulk_s = time.perf_counter() - t0

    rows = [s[0] for s in src]
    n = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while n < max_reps * bs:
        d = dst[(n // bs) % 3]
        i = n % bs
        for a, b in zip(d, rows, strict=True):
            copyto(a[i], b)
        n += 1
        if (n & 255) == 0 and time.perf_counter() > deadline:
            break
    row_s = time.perf_counter() - t0

    return {
        "memcpy_gbps": reps * batch_bytes / bulk_s / 1e9,
        "memcpy_batches": reps,
        "rowcopy_samples_per_s": n / row_s,
        "rowcopy_gbps": n * sc.sample_bytes / row_s / 1e9,
    }


# --------------------------------------------------------------------------- throughput


@dataclass
class _ProducerState:
    produced: int = 0  # real (id-carrying) samples submitted
    markers: int = 0  # end-marker samples submitted after an early stop
    error: str | None = None
    elapsed_s: float = 0.0


def _make_pool(sc: Scenario) -> tuple[list[dict[str, np.ndarray]], list[np.ndarray]]:
    rng = np.random.default_rng(1)
    pool = [
        {k: rng.random(s, dtype=np.float32) for k, s in zip(sc.keys, sc.shapes, strict=True)}
        for _ in range(POOL_SIZE)
    ]
    id_leaves = [p[sc.keys[0]].reshape(-1) for p in pool]  # views; [0] carries the id
    return pool, id_leaves


def _produce(
    server: Server,
    pool: list[dict[str, np.ndarray]],
    id_leaves: list[np.ndarray],
    n: int,
    batch_size: int,
    deadline: float,
    state: _ProducerState,
) -> None:
    t0 = time.perf_counter()
    i = 0
    try:
        submit = server.submit
        clock = time.perf_counter
        while i < n:
            if (i & 255) == 0 and clock() > deadline:
                break
            j = i % POOL_SIZE
            id_leaves[j][0] = i
            submit(pool[j])
            i += 1
        state.produced = i
        if i < n:
            # Early stop: fill up the current batch with end markers (a whole batch of them
            # if at a boundary) so the consumer sees the end without blocking.
            pad = (-i) % batch_size or batch_size
            id_leaves[0][0] = END_MARKER
            for _ in range(pad):
                submit(pool[0])
            state.markers = pad
    except BaseException as e:  # record it, wake the consumer, let threading report it
        state.produced = i
        state.error = f"{type(e).__name__}: {e}"
        server.close()
        raise
    finally:
        state.elapsed_s = time.perf_counter() - t0


def bench_throughput(sc: Scenario, n: int, seconds: float) -> dict[str, Any]:
    bs = sc.batch_size
    n = min(n - n % bs, ID_LIMIT - ID_LIMIT % bs)
    n_batches = n // bs
    pool, id_leaves = _make_pool(sc)
    keys = sc.keys
    touches = [_touch_fn((bs, *s)) for s in sc.shapes]
    expected = np.arange(n, dtype=np.float32).reshape(n_batches, bs)
    counts = np.zeros(n, np.int32)  # deliveries per id
    bad_ids = 0  # ids outside [0, n) that are not end markers
    in_order = True
    saw_marker = False
    closed_early = False
    consumed_batches = 0
    wait_ns = touch_ns = verify_ns = 0

    server = Server(sc.example(), batch_size=bs)
    state = _ProducerState()
    guard = h.call_later(seconds + CLOSE_GRACE_S, server.close)
    try:
        producer = threading.Thread(
            target=_produce,
            args=(server, pool, id_leaves, n, bs, time.perf_counter() + seconds, state),
            name="bench-producer",
            daemon=True,
        )
        clock = time.perf_counter_ns
        t_start = time.perf_counter()
        producer.start()
        for k in range(n_batches):
            t0 = clock()
            smp = server.sample()
            t1 = clock()
            wait_ns += t1 - t0
            if smp is None:
                closed_early = True
                break
            batch = smp.batch
            for key, touch in zip(keys, touches, strict=True):
                touch(batch[key])
            t2 = clock()
            touch_ns += t2 - t1
            col = batch[keys[0]].reshape(bs, -1)[:, 0]
            if (col == expected[k]).all():
                counts[k * bs : (k + 1) * bs] += 1
            else:  # slow path: out of order, end markers, or wrong ids
                marker = col == END_MARKER
                saw_marker = bool(marker.any())
                real = col[~marker]
                if not (real == expected[k][: real.size]).all():
                    in_order = False
                ids = real.astype(np.int64)
                ok = (ids >= 0) & (ids < n) & (ids == real)
                bad_ids += int((~ok).sum())
                np.add.at(counts, ids[ok], 1)
            verify_ns += clock() - t2
            consumed_batches += 1
            if saw_marker:
                break
        elapsed = time.perf_counter() - t_start
        producer.join(timeout=5.0)
        producer_stuck = producer.is_alive()
    finally:
        guard.cancel()
        server.close()

    produced = state.produced
    delivered = consumed_batches * bs - state.markers if saw_marker else consumed_batches * bs
    correct = (
        state.error is None
        and not producer_stuck
        and not closed_early
        and bad_ids == 0
        and bool((counts[:produced] == 1).all())
        and not bool(counts[produced:].any())
    )
    return {
        "n_target": n,
        "n_submitted": produced,
        "n_delivered": delivered,
        "elapsed_s": elapsed,
        "samples_per_s": delivered / elapsed,
        "gbps": delivered * sc.sample_bytes / elapsed / 1e9,
        "correct": correct,
        "in_order": in_order,
        "truncated": produced < n,
        "producer_error": state.error,
        "producer_stuck": producer_stuck,
        "closed_early": closed_early,
        "consumer_wait_s": wait_ns / 1e9,
        "consumer_touch_s": touch_ns / 1e9,
        "consumer_verify_s": verify_ns / 1e9,
        "producer_s": state.elapsed_s,
    }


# --------------------------------------------------------------------------- sample() overhead


def bench_sample_overhead(sc: Scenario, n_timed: int, seconds: float) -> dict[str, Any]:
    bs = sc.batch_size
    pool, _ = _make_pool(sc)
    warmup = max(3, n_timed // 20)
    times = np.zeros(n_timed, np.int64)
    got = 0
    error: str | None = None
    server = Server(sc.example(), batch_size=bs)
    guard = h.call_later(seconds + CLOSE_GRACE_S, server.close)
    try:
        clock = time.perf_counter_ns
        deadline = time.perf_counter() + seconds
        smp: Any = None
        for k in range(warmup + n_timed):
            smp = None  # drop the previous batch's views outside the timed region
            for j in range(bs):
                server.submit(pool[j % POOL_SIZE])
            t0 = clock()
            smp = server.sample()
            t1 = clock()
            if smp is None:
                break
            if k >= warmup:
                times[got] = t1 - t0
                got += 1
            if time.perf_counter() > deadline:
                break
        smp = None
    except (RuntimeError, ValueError, TypeError, OSError) as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        guard.cancel()
        server.close()
    t = times[:got]
    if got == 0:
        return {"n": 0, "error": error}
    return {
        "n": got,
        "error": error,
        "p50_us": _percentile_us(t, 50),
        "p99_us": _percentile_us(t, 99),
        "mean_us": float(t.mean()) / 1e3,
        "min_us": float(t.min()) / 1e3,
        "max_us": float(t.max()) / 1e3,
    }


# --------------------------------------------------------------------------- driver


def run_scenario(sc: Scenario, quick: bool, seconds: float) -> dict[str, Any]:
    ref = bench_memcpy(sc, 0.1 if quick else 0.5)
    n = sc.n_samples_quick if quick else sc.n_samples
    tp = bench_throughput(sc, n, seconds)
    n_ov = sc.n_overhead_quick if quick else sc.n_overhead
    ov = bench_sample_overhead(sc, n_ov, seconds)
    return {
        "batch_size": sc.batch_size,
        "leaves": len(sc.shapes),
        "sample_bytes": sc.sample_bytes,
        "touch": "np.bitwise_or.reduce over a uint64 (else uint8) view of every leaf",
        **tp,
        "frac_of_memcpy": tp["gbps"] / ref["memcpy_gbps"],
        **ref,
        "sample_overhead": ov,
    }


def _print_table(label: str, results: dict[str, dict[str, Any]]) -> None:
    head = (
        f"{'scenario':<8} {'samples/s':>11} {'GB/s':>8} {'memcpy':>8} {'frac':>7} "
        f"{'p50 us':>8} {'p99 us':>8} {'correct':>7} {'order':>5} {'trunc':>5}"
    )
    print(h.run_title(label, echo))
    print(head)
    for name, r in results.items():
        ov = r["sample_overhead"]
        print(
            f"{name:<8} {r['samples_per_s']:>11,.0f} {r['gbps']:>8.3f} {r['memcpy_gbps']:>8.2f} "
            f"{r['frac_of_memcpy']:>7.4f} {h.fmt_num(ov.get('p50_us'), '.1f', 8)} "
            f"{h.fmt_num(ov.get('p99_us'), '.1f', 8)} {r['correct']!s:>7} "
            f"{r['in_order']!s:>5} {r['truncated']!s:>5}"
        )
    for name, r in results.items():
        print(
            f"  {name}: consumer wait {r['consumer_wait_s']:.2f} s, touch "
            f"{r['consumer_touch_s']:.2f} s, verify {r['consumer_verify_s']:.2f} s of "
            f"{r['elapsed_s']:.2f} s; rowcopy {r['rowcopy_samples_per_s']:,.0f} samples/s"
        )
        if r["producer_error"]:
            print(f"  {name}: producer error: {r['producer_error']}")
        if r["sample_overhead"].get("error"):
            print(f"  {name}: sample_overhead error: {r['sample_overhead']['error']}")
    print(f"  load average (1/5/15 min) at the end: {os.getloadavg()}")


def main(argv: list[str] | None = None) -> int:
    p = h.bench_parser(__doc__, "tiny N, a couple of seconds in total", max_seconds=300.0)
    p.add_argument("--only", choices=[s.name for s in SCENARIOS], action="append", default=None)
    p.add_argument("--seconds", type=float, default=20.0, help="time bound per phase")
    args = p.parse_args(argv)

    h.start_watchdog(args.max_seconds, "bench_inprocess")
    load_before = h.loadavg()
    label = h.default_label(args.label, echo)
    results: dict[str, dict[str, Any]] = {}
    for sc in SCENARIOS:
        if args.only and sc.name not in args.only:
            continue
        results[sc.name] = run_scenario(sc, args.quick, args.seconds)

    _print_table(label, results)
    if args.json is not None:
        doc = {
            **h.run_facts(label, echo),
            "loadavg_before": load_before,
            "loadavg_after": h.loadavg(),
            "quick": args.quick,
            "scenarios": results,
        }
        h.write_json(args.json, doc)
    ok = all(r["correct"] for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
