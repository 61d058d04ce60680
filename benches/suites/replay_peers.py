"""Peer replay-buffer benchmark: DeepMind Reverb and TorchRL, for comparison with echo.

Standalone: it does NOT import echo. Run it under a separate virtualenv that holds the
peers (they pin TensorFlow / torch versions echo must not depend on), e.g.::

    python3.11 -m venv /work/venvs/replay-peers
    /work/venvs/replay-peers/bin/pip install 'dm-reverb[tensorflow]==0.14.0' torchrl
    /work/venvs/replay-peers/bin/python -m benches.suites.replay_peers \
        --items 1000000 --batch 256 --seconds 3 --only all --json /tmp/peers.json

Item = three leaves: ``obs`` float32[8], ``action`` int32 scalar, ``reward`` float32
scalar. For each library that imports, the script measures:

* ``fill``: insert N items into a buffer of max_size N whose sampler is prioritized with
  exponent 0.6 (and a uniform one) -> inserts/s. Reverb: items carry random priorities.
* ``sample``: from the full buffer, batches of ``--batch``, uniform and prioritized ->
  batches/s and items/s.
* ``update_priorities`` of ``--batch`` random keys with random priorities -> calls/s, keys/s.

Reverb specifics
  * The server runs by default in a separate (spawned) process and every client call goes
    over gRPC on 127.0.0.1 (``--reverb-server process``). If server and sampler share a
    process Reverb bypasses gRPC for sampling ("accessed directly without gRPC"), which
    ``--reverb-server inprocess`` measures instead. Note that Reverb 0.14's server binds
    ``[::]:PORT`` (all interfaces; no host option); all traffic here goes to 127.0.0.1.
  * Tables: ``prio`` (``Prioritized(0.6)``), ``unif`` (``Uniform``), both Fifo remover,
    ``MinSize(1)`` rate limiter, max_size N; plus a small ``scratch`` prioritized table for
    the per-path insert comparison.
  * Fill path: the fastest one found, ``client.writer(max_sequence_length=16,
    chunk_length=16, max_in_flight_items=None)`` with per-item ``append`` +
    ``create_item(table, num_timesteps=1, priority)`` (a documented, though legacy, API;
    items of length 1 that share 16-step chunks). Also reported, bounded in count and time
    on the scratch table: ``client.insert`` per item, ``client.trajectory_writer(1)`` with
    per-item ``create_item`` (the API Reverb recommends), and the legacy writer with its
    defaults (chunk 1, 25 in-flight items).
  * Sampling: ``client.sample(table, num_samples=B, emit_timesteps=False)`` + np.stack into
    a batch (Reverb's docstring says not to use it for training), and
    ``reverb.TrajectoryDataset(...).batch(B).prefetch(2)`` iterated eagerly with ``.numpy()``
    on every leaf (the tf.data training path).
  * update_priorities: ``client.mutate_priorities(table, updates={key: prio})`` with keys
    drawn from a pool collected by sampling the table (dicts prebuilt, untimed).

TorchRL specifics
  * ``ReplayBuffer(storage=LazyTensorStorage(N), sampler=PrioritizedSampler(N, alpha=0.6,
    beta=0.4), batch_size=B)`` (and ``RandomSampler`` for uniform) holding a TensorDict.
  * Fill with ``extend`` in chunks of ``--chunk`` (10_000) items, with the default
    (max-so-far) priority, and again with ``extend`` + ``update_priority(idx, random)``
    per chunk so that items carry random priorities like the Reverb fill; each fill takes
    ~0.1 s at N=1e6, so it is repeated ``--fill-repeats`` times (median). Single-item
    ``add`` rate over a bounded count (20k items or ``--seconds``), items prebuilt.
  * Sampling: ``rb.sample()``; update_priorities: ``rb.update_priority(idx, prio)`` with
    random indices in [0, N) (prebuilt tensors).

Every loop is bounded in count and in time (``--seconds`` per measurement, ``--fill-seconds``
per fill). ``--only all`` runs each library in its own subprocess (TensorFlow and torch in
one process is asking for trouble) and merges the results.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from benches import common as h

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

OBS_DIM = 8


def _versions(names):
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for n in names:
        try:
            out[n] = version(n)
        except PackageNotFoundError:
            out[n] = None
    return out


def _inserts(done, dt):
    return {"items": done, "seconds": dt, "inserts_per_s": h.rate(done, dt)}


def _batches(calls, dt, b):
    rates = {"batches_per_s": h.rate(calls, dt), "items_per_s": h.rate(calls * b, dt)}
    return {"batches": calls, "seconds": dt, **rates}


def _updates(calls, dt, b, **extra):
    rates = {"calls_per_s": h.rate(calls, dt), "keys_per_s": h.rate(calls * b, dt)}
    return {"calls": calls, "seconds": dt, **extra, **rates}


def _insert_loop(add, n, deadline, every):
    """Calls ``add(i)`` for i in [0, n) until ``deadline`` (checked every ``every`` items);
    returns how many items it added."""
    done = 0
    for i in range(n):
        add(i)
        done += 1
        if done % every == 0 and time.perf_counter() > deadline:
            break
    return done


def make_data(n, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((n, OBS_DIM), dtype=np.float32)
    action = rng.integers(0, 16, size=n, dtype=np.int32)
    reward = rng.random(n, dtype=np.float32)
    prio = (rng.random(n) + 1e-3).astype(np.float64)
    return obs, action, reward, prio


# ----------------------------------------------------------------------------------------
# Reverb
# ----------------------------------------------------------------------------------------

SCRATCH_SIZE = 100_000


def _reverb_tables(n):
    import reverb

    def table(name, sampler, size):
        return reverb.Table(
            name=name,
            sampler=sampler,
            remover=reverb.selectors.Fifo(),
            max_size=size,
            rate_limiter=reverb.rate_limiters.MinSize(1),
        )

    return [
        table("prio", reverb.selectors.Prioritized(0.6), n),
        table("unif", reverb.selectors.Uniform(), n),
        table("scratch", reverb.selectors.Prioritized(0.6), SCRATCH_SIZE),
    ]


def _reverb_server_main(n, port_queue, stop_event, max_lifetime_s):
    """Child process: host the Reverb server until told to stop (bounded lifetime)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import reverb

    server = reverb.Server(tables=_reverb_tables(n), port=None)
    port_queue.put(server.port)
    parent = os.getppid()
    deadline = time.monotonic() + max_lifetime_s
    while time.monotonic() < deadline:
        if stop_event.wait(1.0) or os.getppid() != parent:
            break
    server.stop()


class _ReverbServerHandle:
    def __init__(self, n, mode, max_lifetime_s):
        self.mode = mode
        if mode == "inprocess":
            import reverb

            self._server = reverb.Server(tables=_reverb_tables(n), port=None)
            self.port = self._server.port
            self.pid = os.getpid()
        else:
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            self._stop = ctx.Event()
            self._proc = ctx.Process(
                target=_reverb_server_main, args=(n, q, self._stop, max_lifetime_s), daemon=True
            )
            self._proc.start()
            self.port = q.get(timeout=120)
            self.pid = self._proc.pid

    def rss_mib(self):
        kib = h.proc_kib(f"/proc/{self.pid}/status", "VmRSS").get("VmRSS")
        return None if kib is None else kib / 1024.0

    def stop(self):
        if self.mode == "inprocess":
            self._server.stop()
        else:
            self._stop.set()
            self._proc.join(30)
            if self._proc.is_alive():
                self._proc.terminate()  # our own child, by handle
                self._proc.join(10)


# the fastest legacy writer found: 16-step chunks, unlimited in-flight items
FAST_WRITER = {"max_sequence_length": 16, "chunk_length": 16, "max_in_flight_items": None}


def _writer_fill(client, writer_kwargs, table, data, n, deadline, every):
    """``n`` items through ``client.writer(**writer_kwargs)``, one ``create_item`` each."""
    obs, action, reward, prio = data
    with client.writer(**writer_kwargs) as w:

        def add(i):
            w.append((obs[i], action[i], reward[i]))
            w.create_item(table, 1, prio[i])

        return _insert_loop(add, n, deadline, every)


def _reverb_fill(client, table, data, n, deadline):
    """Fastest path found: legacy writer, 16-step chunks, unlimited in-flight items."""
    t0 = time.perf_counter()
    done = _writer_fill(client, FAST_WRITER, table, data, n, deadline, 4096)
    return done, time.perf_counter() - t0


def _reverb_insert_paths(client, data, args):
    """Bounded (count and time) per-item insert paths on the scratch table."""
    obs, action, reward, prio = data
    out = {}
    n = len(prio)

    def run(name, max_items, body):
        t0 = time.perf_counter()
        done = body(min(max_items, n), t0 + args.seconds)
        out[name] = _inserts(done, time.perf_counter() - t0)

    def b_insert(m, deadline):
        def add(i):
            client.insert((obs[i], action[i], reward[i]), {"scratch": prio[i]})

        return _insert_loop(add, m, deadline, 256)

    def b_traj(m, deadline):
        with client.trajectory_writer(num_keep_alive_refs=1) as w:

            def add(i):
                w.append((obs[i], action[i], reward[i]))
                w.create_item("scratch", prio[i], tuple(col[-1] for col in w.history))

            done = _insert_loop(add, m, deadline, 1024)
            w.flush()
        return done

    def b_writer(kwargs):
        return lambda m, deadline: _writer_fill(client, kwargs, "scratch", data, m, deadline, 1024)

    run("client.insert", 20_000, b_insert)
    run("trajectory_writer(1)+create_item", SCRATCH_SIZE, b_traj)
    run("writer(1) defaults+create_item", SCRATCH_SIZE, b_writer({"max_sequence_length": 1}))
    run("writer(16,chunk16,inflight=None)+create_item", SCRATCH_SIZE, b_writer(FAST_WRITER))
    return out


def bench_reverb(args):
    import numpy as np
    import reverb
    import tensorflow as tf

    res = {
        "library": "reverb",
        "versions": _versions(["dm-reverb", "tensorflow", "numpy"]),
        "server_mode": args.reverb_server,
        "load_before": h.loadavg(),
    }
    n, b, secs = args.items, args.batch, args.seconds
    obs, action, reward, prio_np = make_data(n)
    prio = prio_np.tolist()  # python floats, untimed
    ones = [1.0] * n

    srv = _ReverbServerHandle(n, args.reverb_server, max_lifetime_s=args.fill_seconds * 3 + 1800)
    addr = f"127.0.0.1:{srv.port}"
    res["server_address"] = addr
    client = reverb.Client(addr)
    try:
        # --- fill
        fill = {}
        for table, pr in (("prio", prio), ("unif", ones)):
            deadline = time.perf_counter() + args.fill_seconds
            done, dt = _reverb_fill(client, table, (obs, action, reward, pr), n, deadline)
            size = client.server_info()[table].current_size
            fill[table] = {**_inserts(done, dt), "table_size": size, "full": size >= n}
            print(
                f"[reverb] fill {table}: {done} items in {dt:.1f}s -> {h.rate(done, dt):,.0f}/s "
                f"(table size {size})",
                flush=True,
            )
        res["fill"] = fill
        res["fill_path"] = (
            "client.writer(max_sequence_length=16, chunk_length=16, max_in_flight_items=None)"
            " append+create_item(table,1,prio)"
        )
        res["server_rss_mib_after_fill"] = srv.rss_mib()

        # --- per-path insert comparison (scratch table)
        data = (obs, action, reward, prio)
        res["insert_paths"] = _reverb_insert_paths(client, data, args)
        for k, v in res["insert_paths"].items():
            print(
                f"[reverb] insert path {k}: {v['inserts_per_s']:,.0f}/s ({v['items']} items)",
                flush=True,
            )

        # --- sampling
        sample = {}
        keys_seen = []
        for table in ("unif", "prio"):

            def client_sample(table=table):
                ss = list(client.sample(table, num_samples=b, emit_timesteps=False))
                # legacy-writer items are 1-step trajectories: leaves are [1, ...]
                o = np.stack([s.data[0] for s in ss]).reshape(b, OBS_DIM)
                a = np.stack([s.data[1] for s in ss]).reshape(b)
                r = np.stack([s.data[2] for s in ss]).reshape(b)
                if table == "prio" and len(keys_seen) < 16 * b:
                    keys_seen.extend(s.info.key for s in ss)
                assert o.shape == (b, OBS_DIM)
                assert a.shape == (b,)
                assert r.shape == (b,)

            calls, dt = h.timed_loop(client_sample, secs, args.max_iters)
            sample[f"client.sample/{table}"] = _batches(calls, dt, b)

            ds = (
                reverb.TrajectoryDataset(
                    server_address=addr,
                    table=table,
                    dtypes=(tf.float32, tf.int32, tf.float32),
                    shapes=(tf.TensorShape([1, OBS_DIM]), tf.TensorShape([1]), tf.TensorShape([1])),
                    max_in_flight_samples_per_worker=2 * b,
                )
                .batch(b, drop_remainder=True)
                .prefetch(2)
            )
            it = iter(ds)

            def ds_sample(it=it, table=table):
                s = next(it)
                o, a, r = (x.numpy() for x in s.data)
                o, a, r = o.reshape(b, OBS_DIM), a.reshape(b), r.reshape(b)  # views
                k = s.info.key.numpy()
                if table == "prio" and len(keys_seen) < 64 * b:
                    keys_seen.extend(int(x) for x in k)
                assert o.shape == (b, OBS_DIM)
                assert a.shape == (b,)
                assert r.shape == (b,)

            calls, dt = h.timed_loop(ds_sample, secs, args.max_iters, warmup=5)
            sample[f"TrajectoryDataset/{table}"] = _batches(calls, dt, b)
            del it, ds
        res["sample"] = sample
        for k, v in sample.items():
            print(
                f"[reverb] sample {k}: {v['batches_per_s']:,.1f} batches/s "
                f"({v['items_per_s']:,.0f} items/s)",
                flush=True,
            )

        # --- update priorities
        rng = np.random.default_rng(1)
        pool = np.array(sorted(set(keys_seen)), dtype=np.uint64)
        n_dicts = 64
        dicts = []
        for _ in range(n_dicts):
            ks = rng.choice(pool, size=min(b, len(pool)), replace=len(pool) < b)
            ps = rng.random(len(ks)) + 1e-3
            dicts.append(dict(zip((int(k) for k in ks), ps.tolist(), strict=True)))
        ctr = [0]

        def mutate():
            client.mutate_priorities("prio", updates=dicts[ctr[0] % n_dicts])
            ctr[0] += 1

        calls, dt = h.timed_loop(mutate, secs, args.max_iters)
        res["update_priorities"] = u = _updates(
            calls,
            dt,
            b,
            key_pool=len(pool),
            path="client.mutate_priorities('prio', updates={key: prio} x batch)",
        )
        print(
            f"[reverb] mutate_priorities: {u['calls_per_s']:,.1f} calls/s "
            f"({u['keys_per_s']:,.0f} keys/s, pool {len(pool)} keys)",
            flush=True,
        )
    finally:
        srv.stop()
    res["load_after"] = h.loadavg()
    return res


# ----------------------------------------------------------------------------------------
# TorchRL
# ----------------------------------------------------------------------------------------


def bench_torchrl(args):
    import numpy as np
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, PrioritizedSampler, RandomSampler, ReplayBuffer

    res = {
        "library": "torchrl",
        "versions": _versions(["torchrl", "tensordict", "torch", "numpy"]),
        "torch_num_threads": torch.get_num_threads(),
        "load_before": h.loadavg(),
    }
    n, b, secs, chunk = args.items, args.batch, args.seconds, args.chunk
    obs, action, reward, prio_np = make_data(n)
    full = TensorDict(
        {
            "obs": torch.from_numpy(obs),
            "action": torch.from_numpy(action),
            "reward": torch.from_numpy(reward),
        },
        batch_size=[n],
    )
    prio_t = torch.from_numpy(prio_np.astype(np.float32))  # sum tree is float32

    def make_rb(kind):
        sampler = PrioritizedSampler(n, alpha=0.6, beta=0.4) if kind == "prio" else RandomSampler()
        return ReplayBuffer(storage=LazyTensorStorage(n), sampler=sampler, batch_size=b)

    def fill(rb, with_prio):
        t0 = time.perf_counter()
        deadline = t0 + args.fill_seconds
        done = 0
        for start in range(0, n, chunk):
            part = full[start : start + chunk]
            idx = rb.extend(part)
            if with_prio:
                rb.update_priority(idx, prio_t[start : start + len(part)])
            done += len(part)
            if time.perf_counter() > deadline:
                break
        return done, time.perf_counter() - t0

    # untimed warm-up: one full-size fill per kind. The very first fill of a fresh process
    # is several times slower (first touch of ~N*40 B of new pages, lazy imports inside
    # torchrl); it is reported separately as "cold" and not used in the fill numbers.
    cold = {}
    for kind in ("prio", "unif"):
        w = make_rb(kind)
        t0 = time.perf_counter()
        for start in range(0, n, chunk):
            w.extend(full[start : start + chunk])
            if time.perf_counter() - t0 > args.fill_seconds:
                break
        dt = time.perf_counter() - t0
        cold[kind] = _inserts(len(w), dt)
        print(f"[torchrl] cold fill {kind} (warm-up): {h.rate(len(w), dt):,.0f}/s", flush=True)
        w.sample()
        del w
    res["fill_cold_first_in_process"] = cold

    fills = {}
    buffers = {}
    for name, kind, with_prio in (
        ("extend/prio(default max priority)", "prio", False),
        ("extend+update_priority/prio(random priorities)", "prio", True),
        ("extend/uniform", "unif", False),
    ):
        # a warm 1e6 fill takes ~0.1 s here, so repeat it (fresh buffer each time) and keep
        # the median; the last buffer is kept for sampling
        runs = []
        rb = None
        for _ in range(max(1, args.fill_repeats)):
            rb = None  # free the previous buffer before building the next one
            rb = make_rb(kind)
            done, dt = fill(rb, with_prio)
            runs.append((done, dt))
        rates = sorted(h.rate(d, t) for d, t in runs)
        done, dt = runs[-1]
        med = rates[len(rates) // 2]
        fills[name] = {
            "items": done,
            "buffer_len": len(rb),
            "seconds": dt,
            "inserts_per_s": med,
            "inserts_per_s_all": [h.rate(d, t) for d, t in runs],
            "full": len(rb) >= n,
            "chunk": chunk,
        }
        print(
            f"[torchrl] fill {name}: {done} items, median {med:,.0f}/s over "
            f"{len(runs)} fills ({', '.join(f'{r:,.0f}' for r in rates)})",
            flush=True,
        )
        if with_prio or kind == "unif":
            buffers[kind] = rb
        else:
            del rb
    res["fill"] = fills

    # single-item add, bounded in count and time, items prebuilt (untimed)
    m = min(args.add_items, n)
    singles = [full[i] for i in range(m)]
    add_res = {}
    for kind in ("prio", "unif"):
        rb = make_rb(kind)
        t0 = time.perf_counter()
        done = _insert_loop(lambda i, add=rb.add, xs=singles: add(xs[i]), m, t0 + secs, 256)
        dt = time.perf_counter() - t0
        add_res[kind] = _inserts(done, dt)
        print(f"[torchrl] add single {kind}: {h.rate(done, dt):,.0f}/s ({done} items)", flush=True)
        del rb
    res["add_single"] = add_res
    del singles

    sample = {}
    for kind, label in (("unif", "uniform"), ("prio", "prioritized")):
        rb = buffers[kind]

        def s(rb=rb):
            out = rb.sample()
            assert out.batch_size[0] == b

        calls, dt = h.timed_loop(s, secs, args.max_iters)
        sample[label] = v = _batches(calls, dt, b)
        print(
            f"[torchrl] sample {label}: {v['batches_per_s']:,.1f} batches/s "
            f"({v['items_per_s']:,.0f} items/s)",
            flush=True,
        )
    res["sample"] = sample

    g = torch.Generator().manual_seed(1)
    n_sets = 64
    idx_sets = [torch.randint(0, n, (b,), generator=g) for _ in range(n_sets)]
    pr_sets = [torch.rand(b, generator=g) + 1e-3 for _ in range(n_sets)]
    ctr = [0]
    rbp = buffers["prio"]

    def upd():
        k = ctr[0] % n_sets
        rbp.update_priority(idx_sets[k], pr_sets[k])
        ctr[0] += 1

    calls, dt = h.timed_loop(upd, secs, args.max_iters)
    res["update_priorities"] = u = _updates(
        calls, dt, b, path="ReplayBuffer.update_priority(idx_tensor, prio_tensor)"
    )
    print(
        f"[torchrl] update_priority: {u['calls_per_s']:,.1f} calls/s "
        f"({u['keys_per_s']:,.0f} keys/s)",
        flush=True,
    )
    res["load_after"] = h.loadavg()
    return res


# ----------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------


# (result section, row label, main cell, detail cell), formatted with the section's entries
TABLE = (
    ("fill", "fill {k}", "{inserts_per_s:,.0f} inserts/s", "{items:,} items, {seconds:.1f}s"),
    ("insert_paths", "insert path {k}", "{inserts_per_s:,.0f} inserts/s", "{items:,} items"),
    ("add_single", "add single {k}", "{inserts_per_s:,.0f} inserts/s", "{items:,} items"),
    (
        "sample",
        "sample {k} (B={b})",
        "{batches_per_s:,.1f} batches/s",
        "{items_per_s:,.0f} items/s",
    ),
    (
        "update_priorities",
        "update_priorities (B={b})",
        "{calls_per_s:,.1f} calls/s",
        "{keys_per_s:,.0f} keys/s",
    ),
)


def _print_table(results, batch):
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append((name, "ERROR", r["error"][:100], ""))
            continue
        for section, *cells in TABLE:
            entries = r.get(section) or {}
            if section == "update_priorities":  # one entry, not one per path or table
                entries = {"": entries} if entries else {}
            for k, v in entries.items():
                rows.append((name, *(c.format(k=k, b=batch, **v) for c in cells)))
    h.print_columns(rows)


# the options that --only all passes on to its per-library children
CHILD_OPTIONS = (
    "items",
    "batch",
    "seconds",
    "fill_seconds",
    "max_iters",
    "chunk",
    "add_items",
    "fill_repeats",
    "reverb_server",
)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=3.0, help="time cap per measurement")
    ap.add_argument("--fill-seconds", type=float, default=300.0, help="time cap per fill")
    ap.add_argument("--max-iters", type=int, default=1_000_000, help="count cap per measurement")
    ap.add_argument("--chunk", type=int, default=10_000, help="TorchRL extend chunk")
    ap.add_argument("--fill-repeats", type=int, default=3, help="TorchRL fills (median)")
    ap.add_argument("--add-items", type=int, default=20_000, help="TorchRL single add count cap")
    ap.add_argument("--only", choices=["reverb", "torchrl", "all"], default="all")
    ap.add_argument("--reverb-server", choices=["process", "inprocess"], default="process")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child-timeout", type=float, default=2400.0)
    args = ap.parse_args(argv)

    meta = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "args": vars(args),
    }
    results = {}
    libs = ["reverb", "torchrl"] if args.only == "all" else [args.only]
    if args.only == "all":
        for lib in libs:
            cmd = [sys.executable, "-m", "benches.suites.replay_peers", "--only", lib]
            for name in CHILD_OPTIONS:
                cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
            doc = h.run_json_child(cmd, args.child_timeout)
            results.update(doc.get("results") or {lib: {"error": doc.get("error", "no result")}})
    else:
        lib = libs[0]
        fn = bench_reverb if lib == "reverb" else bench_torchrl
        try:
            results[lib] = fn(args)
        except ImportError as e:
            results[lib] = {"error": f"import failed: {e}"}
            print(f"[{lib}] import failed: {e}", flush=True)
        except Exception as e:  # noqa: BLE001 - recorded, so --only all still merges a result
            import traceback

            traceback.print_exc()
            results[lib] = {"error": f"{type(e).__name__}: {e}"}

    print()
    print(f"python {meta['python']}, {meta['cpus']} CPUs, items={args.items:,}, batch={args.batch}")
    for lib, r in results.items():
        if "versions" in r:
            print(f"  {lib}: {r['versions']}")
    _print_table(results, args.batch)
    if args.json:
        h.write_json(args.json, {"meta": meta, "results": results}, say=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
