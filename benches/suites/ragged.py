"""Ragged leaves: synthetic LLM rollouts (``echo.Ragged`` prompt, completion tokens and
log-probabilities, a fixed reward) through an in-process server, against padding, memcpy,
a fixed-shape server of the same bytes, and TorchRL and TransferQueue.

The rollouts (``benches/suites/ragged_data.py``): prompts of 64 to 512 ``int32`` tokens
(uniform), completions lognormal with median 600 tokens, clipped at 8,192, as ``int32``
tokens and ``float32`` log-probabilities (the length group ``"completion"``), and a
``float32`` reward. A pool of distinct rollouts is made before any clock starts and every
loop cycles through it. Every batch is read in full (every byte of every array a library
hands out, ``ragged_data.touch``). The parts (``benches/suites/ragged_child.py``), each in a
process of its own:

- **memory**: a uniform replay table (``max_bytes``, ``max_size`` above what fits) filled
  with ``fill`` rollouts: ``stats().stored_bytes / raw_bytes`` (arena blocks over payload),
  the process's RSS growth over the payload, and the bytes of the same rollouts with every
  ragged leaf padded to its ``max_len`` (a table without ragged leaves).
- **ingest**: ``submit()`` from 1 and ``threads`` threads into a FIFO server, ragged against
  a server with one fixed ``uint8`` leaf of the rollouts' mean bytes, a consumer thread
  reading every batch in both.
- **tcp**: the same two servers on loopback fed by ``tcp_workers`` worker processes
  (``benches/suites/ragged_tcp.py``), each an ``echo.TcpClient`` calling ``send()`` for one
  rollout after another, a learner thread reading every batch; best of ``repeats`` windows of
  ``tcp_seconds`` each; over TCP and through same-host shared memory (``tcp_paths``), the
  fixed-shape workers over the same path as the ragged ones.
- **sample**: packed FIFO batches (a token budget of ``batch_tokens`` completion tokens),
  packed and padded (``pad_to_multiple``) replay batches from a table of ``replay_fill``
  rollouts, in GB/s of what ``sample()`` hands out, against ``np.copyto`` of as many bytes
  (from 64 sources in turn, so not from cache), each with and without the read.
- **peers**: the same rollouts added one at a time to a table of ``peer_fill``, then uniform
  batches of ``peer_batch`` rollouts, in echo and in TorchRL (``ReplayBuffer(storage=
  LazyStackStorage(...))``, TorchRL's storage for heterogeneous shapes, densified into
  jagged nested tensors) and TransferQueue (``put``/``get`` of the same rollouts), each
  ``pip install``ed into a virtualenv of its own under ``~/.cache/echo-bench/peers/<name>``
  (``--set venv_root=DIR``), made by a full run the first time and reused after (as the
  ``peers`` suite does: ``--quick`` never makes one; ``ECHO_PEERS_INSTALL=1`` lets it). A
  peer that cannot be installed or cannot run here is reported with the reason.

Run: ``python -m benches ragged [--quick]``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benches import common as c

# name -> pip requirement, each in its own virtualenv (PyPI's torch: the CPU-only index is
# not always reachable; it runs on the CPU either way)
PEERS = {"torchrl": "torchrl==0.14.1", "transferqueue": "transferqueue==0.1.11"}
INSTALL_TIMEOUT_S = 1800.0  # per peer: torch and its CUDA libraries, about 5 GB
PARTS = ("memory", "ingest", "tcp", "sample", "echo_peer")  # echo's, each in a child


def parameters(quick: bool) -> dict[str, Any]:
    common: dict[str, Any] = {
        "prompt_min": 64,
        "prompt_max": 512,
        "completion_median": 600,
        "completion_sigma": 0.6,
        "completion_max": 8192,
        "max_size": 1_000_000,
        "max_bytes": 1 << 30,
        "batch_tokens": 65_536,
        "sample_batch": 1024,
        "pad_to_multiple": 64,
        "ingest_batch": 64,
        "peer_batch": 64,
        "peers": ["torchrl", "transferqueue"],
        "tq_storage_units": 1,
        "tq_ray_cpus": None,
        "venv_root": str(Path.home() / ".cache" / "echo-bench" / "peers"),
        "max_calls": 1_000_000,
        "max_samples": 10_000_000,
    }
    if quick:
        return {
            **common,
            "pool": 200,
            "fill": 2_000,
            "threads": [1, 2],
            "ingest_seconds": 0.3,
            "tcp_workers": 2,
            "tcp_paths": ["tcp", "shm"],
            "tcp_warmup": 0.1,
            "tcp_seconds": 0.3,
            "fifo_fill": 200,
            "replay_fill": 2_000,
            "peer_fill": 1_000,
            "tq_fill": 200,
            "seconds": 0.3,
            "repeats": 1,
            "child_timeout": 120.0,
            "install": False,
        }
    return {
        **common,
        "pool": 2_000,
        "fill": 20_000,
        "threads": [1, 4],
        "ingest_seconds": 2.0,
        "tcp_workers": 16,
        "tcp_paths": ["tcp", "shm"],
        "tcp_warmup": 0.5,
        "tcp_seconds": 2.0,
        "fifo_fill": 2_000,
        "replay_fill": 20_000,
        "peer_fill": 20_000,
        "tq_fill": 2_000,
        "seconds": 2.0,
        "repeats": 3,
        "child_timeout": 300.0,
        "install": True,
    }


def _install_allowed(params: dict[str, Any]) -> bool:
    env = os.environ.get("ECHO_PEERS_INSTALL")
    if env in ("0", "1"):
        return env == "1"
    return bool(params["install"])


def limit_s(params: dict[str, Any]) -> float:
    children = 4 + len(params["peers"]) + 1
    install = INSTALL_TIMEOUT_S * len(params["peers"]) if _install_allowed(params) else 0.0
    return children * (float(params["child_timeout"]) + 30.0) + install


def _child(python: str, part: str, params: dict[str, Any], log: Any) -> dict[str, Any]:
    log(f"{part} ({python})")
    cmd = [python, "-m", "benches.suites.ragged_child", part, json.dumps(params)]
    return c.run_json_child(cmd, float(params["child_timeout"]) + 30.0)


def measure(params: dict[str, Any]) -> dict[str, Any]:
    from benches.suites import peers as peers_suite

    log = c.logger("ragged")
    t0 = time.monotonic()
    out: dict[str, Any] = {}
    for part in PARTS:
        out[part] = _child(sys.executable, part, params, log)
    root = Path(os.path.expanduser(str(params["venv_root"])))
    install = _install_allowed(params)
    out["setup"] = {}
    for name in params["peers"]:
        python, how = peers_suite.ensure_venv(name, PEERS[name], root, install, log)
        out["setup"][name] = {"requirement": PEERS[name], "python": python, "status": how}
        log(f"{name}: {how}")
        out[name] = (
            _child(python, name, params, log) if python else {"error": how, "not_installed": True}
        )
    correct = True
    for part in PARTS:
        r = out[part]
        if "error" in r or not r.get("correct", False):
            log(f"{part}: not correct: {r.get('error', '')}")
            correct = False
    for name in params["peers"]:
        r = out[name]
        if "error" not in r and not r.get("correct", False):
            log(f"{name}: its batches were not what was added")
            correct = False
    out["correct"] = correct
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


# --------------------------------------------------------------------------- tables


def _gb(v: Any) -> str:
    return c.num(v, ".2f")


def _x(a: Any, b: Any) -> str:
    return c.fmt_ratio(a, b, 0).strip()


def _err(r: dict[str, Any]) -> str:
    return str(r.get("error", ""))[:160]


def _memory_table(r: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    m = r.get("memory", {})
    cols = ["what", "bytes", "over the payload", "target"]
    if "error" in m:
        return {"title": "Memory", "columns": cols, "rows": [["error", _err(m), "-", "-"]]}
    mib = 1 << 20
    rows = [
        ["payload (the rollouts' own bytes)", f"{m['payload_bytes'] / mib:,.1f} MiB", "1.00x", "-"],
        [
            "stats().raw_bytes",
            f"{m['raw_bytes'] / mib:,.1f} MiB",
            f"{m['raw_bytes'] / m['payload_bytes']:.2f}x",
            "-",
        ],
        [
            "stats().stored_bytes (arena blocks in use)",
            f"{m['stored_bytes'] / mib:,.1f} MiB",
            f"{m['stored_bytes'] / m['payload_bytes']:.3f}x",
            "<= 1.05x",
        ],
        [
            f"process RSS of the empty server (max_size {params['max_size']:,})",
            f"{m['rss_empty_server'] / mib:,.1f} MiB",
            f"{m['rss_empty_server'] / m['payload_bytes']:.3f}x",
            "-",
        ],
        [
            "process RSS growth during the fill",
            f"{m['rss_fill'] / mib:,.1f} MiB",
            f"{m['rss_fill_over_payload']:.3f}x",
            "-",
        ],
        [
            "process RSS growth, server and fill (VmRSS after the fill - before the server)",
            f"{m['rss_growth'] / mib:,.1f} MiB",
            f"{m['rss_growth_over_payload']:.3f}x",
            "-",
        ],
        [
            "every ragged leaf padded to its max_len (a fixed-shape table)",
            f"{m['padded_bytes'] / mib:,.1f} MiB",
            f"{m['padded_over_payload']:.1f}x",
            "-",
        ],
    ]
    return {
        "title": f"Memory: a uniform replay table (max_bytes {params['max_bytes'] / mib:,.0f} "
        f"MiB) filled with {m['samples']:,} rollouts",
        "columns": cols,
        "rows": rows,
        "notes": [
            f"The fill (one thread, no consumer) ran at {m['fill_samples_per_s']:,.0f} "
            f"rollouts/s, {m['fill_gb_per_s']:.2f} GB/s. stored / raw: "
            f"{m['stored_over_raw']:.3f}x. The empty server's RSS is its per-sample "
            f"bookkeeping, {m['rss_empty_server'] / params['max_size']:.0f} bytes for each of "
            "its max_size slots, taken when it is made; the fill then adds the arena blocks it "
            "takes, plus the pages a prefault thread keeps populated ahead of them (at most "
            "16 MiB, so that the inserts do not take the page faults): the RSS rows' excess "
            "over stored_bytes is that window, whatever the table's size."
        ],
    }


def _spread(best: dict[str, Any]) -> str:
    """max/min - 1 of the windows' GB/s: the machine's noise on that row."""
    spread = best.get("spread")
    return "-" if not isinstance(spread, (int, float)) else f"{100 * (spread - 1):.0f}%"


def _leaves_label(g: dict[str, Any]) -> str:
    """The fixed-shape rollouts of the same leaves: their shapes."""
    lengths = g.get("leaves_lengths")
    if not lengths:
        return "fixed (same leaves)"
    prompt, completion = lengths
    return f"fixed (int32[{prompt}], int32[{completion}], float32[{completion}], float32)"


def _ingest_table(r: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    g = r.get("ingest", {})
    cols = [
        "writer threads",
        "server",
        "samples/s",
        "GB/s",
        "ragged / fixed uint8 (bytes/s)",
        "ragged / fixed leaves (bytes/s)",
        "target",
        "spread of windows",
    ]
    if "error" in g:
        return {"title": "Ingest", "columns": cols, "rows": [["error", _err(g), *"------"]]}
    best = g["best"]
    rows = []
    for threads in params["threads"]:
        rg, fx = best.get(f"ragged/{threads}", {}), best.get(f"fixed/{threads}", {})
        lv = best.get(f"leaves/{threads}", {})
        for x, label, ratios, target in (
            (
                rg,
                "ragged",
                [
                    _x(rg.get("gb_per_s"), fx.get("gb_per_s")),
                    _x(rg.get("gb_per_s"), lv.get("gb_per_s")),
                ],
                ">= 0.8x",
            ),
            (fx, f"fixed (uint8[{g['mean_sample_bytes']:,}])", ["-", "-"], "-"),
            (lv, _leaves_label(g), ["-", "-"], "-"),
        ):
            if not x:
                continue
            rows.append(
                [
                    str(threads),
                    label,
                    c.num(x.get("samples_per_s")),
                    _gb(x.get("gb_per_s")),
                    *ratios,
                    target,
                    _spread(x),
                ]
            )
    return {
        "title": f"In-process ingest: submit() into a FIFO server (batches of "
        f"{params['ingest_batch']}), a consumer thread reading every batch; best of "
        f"{params['repeats']} windows of {params['ingest_seconds']:g} s",
        "columns": cols,
        "rows": rows,
        "notes": [
            "fixed uint8: the same server with one uint8 leaf of the rollouts' mean bytes, no "
            "ragged leaf. fixed leaves: the rollouts' four leaves at fixed shapes, the pool's "
            "mean prompt and completion lengths (about the same mean bytes): what a "
            "fixed-shape table would take of the same data with no padding, a pytree of four "
            "leaves as users send. Workers over TCP and shared memory: the next table.",
            "spread of windows: the largest over the smallest window's GB/s, less 1.",
        ],
    }


def _cores(x: dict[str, Any]) -> str:
    """The learner process's CPU by thread (cores over the window, and us a sample), busiest
    first; threads under 0.01 cores left out."""
    names = {"echo-ragged-con": "connection threads", "echo-tcp": "connection threads"}
    names["echo-ragged-pum"] = "pipe pumps"
    names.update({"echo-drainer-": "drainers", "bench-learner": "learner thread"})
    names["python"] = "main thread"
    got: dict[str, float] = {}
    for name, cores in (x.get("learner_thread_cores") or {}).items():
        key = names.get(name, name)
        got[key] = got.get(key, 0.0) + float(cores)
    rate = x.get("samples_per_s") or 0.0
    return ", ".join(
        f"{k} {v:.2f} cores" + (f" ({v / rate * 1e6:.1f} us a sample)" if rate else "")
        for k, v in sorted(got.items(), key=lambda kv: -kv[1])
        if v >= 0.01
    )


def _tcp_table(r: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    t = r.get("tcp", {})
    cols = [
        "workers",
        "server",
        "samples/s",
        "GB/s",
        "ragged / fixed uint8 (bytes/s)",
        "ragged / fixed leaves (bytes/s)",
        "target",
        "spread of windows",
        "worker CPU us a sample",
        "learner process CPU (cores)",
        "learner thread CPU us a batch",
    ]
    title = (
        f"Ingest from {params['tcp_workers']} worker processes over TCP and same-host shared "
        f"memory: send() into a FIFO server on loopback (batches of {params['ingest_batch']}), "
        f"a learner thread reading every batch; best of {params['repeats']} windows of "
        f"{params['tcp_seconds']:g} s"
    )
    cols.insert(1, "path")
    if "error" in t:
        return {"title": title, "columns": cols, "rows": [["error", _err(t), *"-" * 10]]}
    best = t["best"]
    rows = []
    paths = params.get("tcp_paths", ["tcp"])
    for path in paths:
        suffix = "" if path == "tcp" else f"_{path}"
        rg, fx = best.get("ragged" + suffix, {}), best.get("fixed" + suffix, {})
        lv = best.get("leaves" + suffix, {})
        rg_gb = rg.get("gb_per_s")
        for x, label, ratios, target in (
            (
                rg,
                "ragged",
                [_x(rg_gb, fx.get("gb_per_s")), _x(rg_gb, lv.get("gb_per_s"))],
                ">= 0.8x",
            ),
            (fx, f"fixed (uint8[{t['mean_sample_bytes']:,}])", ["-", "-"], "-"),
            (lv, _leaves_label(t), ["-", "-"], "-"),
        ):
            if x:
                rows.append(_tcp_row(t, path, x, label, ratios, target))
    notes = _tcp_notes(best, params)
    return {"title": title, "columns": cols, "rows": rows, "notes": notes}


def _tcp_row(
    t: dict[str, Any], path: str, x: dict[str, Any], label: str, ratios: list[str], target: str
) -> list[str]:
    return [
        str(t["workers"]),
        path,
        label,
        c.num(x.get("samples_per_s")),
        _gb(x.get("gb_per_s")),
        *ratios,
        target,
        _spread(x),
        c.num(x.get("worker_cpu_us_per_sample"), ",.1f"),
        c.num(x.get("learner_cpu_cores"), ".2f"),
        c.num(x.get("learner_cpu_us_per_batch"), ",.0f"),
    ]


def _tcp_notes(best: dict[str, Any], params: dict[str, Any]) -> list[str]:
    return [
        "Each worker is a process with its own echo.TcpClient(shared_memory=False for tcp, "
        "True for shm) and "
        "default max_inflight_msgs, calling send() for one rollout after another from the "
        "suite's pool (made before the clock starts), bounded in count and time; the server "
        'is a FIFO Server(example, batch_size, transport=TcpTransport(host="127.0.0.1")), '
        "its learner thread calls sample() and reads every byte of every batch (and checks "
        f"it). A round: connect, {params['tcp_warmup']:g} s warm-up, the window, then every "
        "client closes and every sample sent is checked to have been read once. samples/s "
        "and GB/s: what the learner read during the window (bytes: each leaf's values). "
        "Rounds alternate which server goes first.",
        "fixed uint8: the same server with one uint8 leaf of the rollouts' mean bytes, no "
        "ragged leaf; fixed leaves: the rollouts' four leaves at the pool's mean lengths; "
        "their workers over the same path. shm: a fixed-shape worker writes each sample "
        "into a slot of its ring in shared memory and the server copies it once into its "
        "queue; a ragged worker writes its frames into a byte pipe in shared memory, whose "
        "headers the server reads and checks as it reads a socket's, and copies each body "
        "that is all in the pipe from there into the table, once.",
        "worker CPU: all the workers' CPU time (their Python and their client's threads) over "
        "the samples they sent. learner process CPU: the server process's CPU time over the "
        "window, by thread in the best windows: "
        + "; ".join(
            f"{key.replace('_', ' over ')}: {_cores(best[key])}"
            for key in ("ragged", "fixed", "leaves", "ragged_shm", "fixed_shm", "leaves_shm")
            if key in best
        )
        + ". learner thread CPU: the reading thread's own CPU time (sample(), the read, the "
        "check) per batch.",
    ]


SAMPLE_ROWS = (
    ("fifo_packed", "FIFO, packed"),
    ("replay_packed", "uniform replay, packed"),
    ("replay_padded", "uniform replay, padded"),
)


def _sample_table(r: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    s = r.get("sample", {})
    cols = [
        "sampler, layout",
        "samples a batch",
        "MB a batch",
        "sample() + read GB/s",
        "memcpy + read GB/s",
        "ratio",
        "sample() alone GB/s",
        "memcpy alone GB/s",
        "ratio alone",
        "zero-copy batches",
        "numpy gather + read GB/s",
        "target",
    ]
    if "error" in s:
        return {"title": "Sampling", "columns": cols, "rows": [["error", _err(s), *"-" * 10]]}
    rows = []
    for key, label in SAMPLE_ROWS:
        x = s[key]
        rows.append(
            [
                label,
                c.num(x["mean_batch_samples"], ".1f"),
                c.num((x["mean_batch_bytes"] or 0) / 1e6, ".2f"),
                _gb(x["read_gb_per_s"]),
                _gb(x["memcpy"]["copy_read_gb_per_s"]),
                f"{x['ratio_read']:.2f}x",
                _gb(x["sample_gb_per_s"]),
                _gb(x["memcpy"]["copy_gb_per_s"]),
                f"{x['ratio_sample']:.2f}x",
                "-" if key == "replay_padded" else f"{x['zero_copy_batches']} of {x['batches']}",
                _gb(x["numpy_gather"]["copy_read_gb_per_s"]) if "numpy_gather" in x else "-",
                "-" if key == "replay_padded" else ">= 0.5x",
            ]
        )
    padded, fifo = s["replay_padded"], s["fifo_packed"]
    waste = (padded["bytes_handed_out"] or 0) / max(1, padded["payload_bytes"] or 1)
    per_call = (
        f"FIFO sample() took {c.num(fifo.get('us_per_view_sample'), ',.0f')} us per zero-copy "
        f"batch and {c.num(fifo.get('us_per_gathered_sample'), ',.0f')} us per gathered one; "
        f"replay {c.num(s['replay_packed'].get('us_per_gathered_sample'), ',.0f')} us per "
        f"packed batch, {c.num(padded.get('us_per_gathered_sample'), ',.0f')} us per padded one."
    )
    return {
        "title": f"Sampling: batches of up to {params['sample_batch']:,} rollouts and "
        f"{params['batch_tokens']:,} completion tokens, every batch read in full",
        "columns": cols,
        "rows": rows,
        "notes": [
            "GB/s of the bytes sample() hands out (every leaf's values; padded: with the "
            f"padding, to a multiple of {params['pad_to_multiple']}, which is "
            f"{waste:.2f}x the rollouts' own bytes). memcpy: np.copyto of a mean batch's "
            "bytes between preallocated buffers, from 64 sources in turn; + read: then a sum "
            "of every byte, as the consumer does with each batch. ratio: echo / memcpy. numpy "
            "gather: the replay table's rollouts in one flat array per leaf, the same number "
            "of rollouts drawn per batch, their rows copied by np.concatenate(slices, out=) "
            "(a sequential memcpy reads one run of memory; a gather reads a few KB from each "
            "of about a hundred places). "
            + (
                f"Without the read: {_gb(s['replay_packed']['numpy_gather']['copy_gb_per_s'])} "
                "GB/s."
                if "numpy_gather" in s["replay_packed"]
                else ""
            ),
            f"FIFO: rounds of {params['fifo_fill']:,} submits (untimed), then sample() until "
            "no full batch is left, each call timed; zero-copy batches are read-only views of "
            "the arena (rows side by side), the others are gathered. Replay: a table of "
            f"{s['replay_stored_samples']:,} rollouts, {params['seconds']:g} s per layout.",
            per_call,
        ],
    }


def _peer_label(name: str, r: dict[str, Any]) -> str:
    v = (r.get("versions") or {}).get(name)
    return f"{name} {v}" if v else name


def _peer_table(r: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    cols = [
        "library",
        "add rollouts/s",
        "add GB/s",
        f"sample rollouts/s (batches of {params['peer_batch']})",
        "sample GB/s",
        "echo / library, add",
        "echo / library, sample",
        "API",
    ]
    e = r.get("echo_peer", {})
    rows = []
    libs = [("echo", e)] + [(name, r.get(name, {})) for name in params["peers"]]
    for name, x in libs:
        if "error" in x:
            rows.append([name, _err(x), *"-" * 5, "-"])
            continue
        api = x.get("api", {})
        rows.append(
            [
                _peer_label(name, x),
                c.num(x["add_samples_per_s"]),
                _gb(x["add_gb_per_s"]),
                c.num(x["sample_samples_per_s"]),
                _gb(x["sample_gb_per_s"]),
                "-" if name == "echo" else _x(e.get("add_samples_per_s"), x["add_samples_per_s"]),
                "-"
                if name == "echo"
                else _x(e.get("sample_samples_per_s"), x["sample_samples_per_s"]),
                "; ".join(f"{k}: {v}" for k, v in api.items()),
            ]
        )
    notes = [
        f"One thread each, in-process: {params['peer_fill']:,} rollouts added one at a time "
        f"(a first fill, timed), then uniform batches of {params['peer_batch']} for "
        f"{params['seconds']:g} s, best of {params['repeats']}; every batch read in full. "
        "Target: echo >= 5x. TorchRL's list storage keeps references to the tensors it is "
        "given (no copy), so its add costs the TensorDict and the list, not the bytes; echo "
        "copies every byte into its arena.",
        f"TransferQueue is not in-process: its store is Ray actors (a controller and storage "
        f"units) reached over ZeroMQ, so each put and get crosses to another process; it gets "
        f"{params['tq_fill']:,} rollouts (its puts are slow), the batches are drawn from those.",
    ]
    for name in params["peers"]:
        x = r.get(name, {})
        if x.get("notes"):
            notes += [f"{name}: {n}" for n in x["notes"]]
    return {
        "title": "Against TorchRL and TransferQueue: the same rollouts in, batches out",
        "columns": cols,
        "rows": rows,
        "notes": notes,
    }


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    r = results.get("ours", {})
    if "error" in r:
        return [{"title": "Ragged", "columns": ["echo", "error"], "rows": [["ours", _err(r)]]}]
    out = [_memory_table(r, params), _ingest_table(r, params), _tcp_table(r, params)]
    out.append(_sample_table(r, params))
    out.append(_peer_table(r, params))
    return out
