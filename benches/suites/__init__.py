"""The suites of ``python -m benches``: one measurement each, with a name and a one-line
description (``python -m benches --list``).

A suite is a module with four functions (see ``accept_flood.py`` for a small one). It may
import numpy and echo at module level: only the driver and the child that measures import
it, never ``python -m benches --list`` or ``report``.

``parameters(quick: bool) -> dict``
    The suite's parameters, the smaller ``--quick`` set or the full one. ``--set KEY=VALUE``
    overrides any of them (the value is read as JSON, else kept as a string).
``measure(params: dict) -> dict``
    The measurement. It runs in a child process of the interpreter under test (ours, and
    with ``--compare PYTHON`` that one too), from the repository root, and returns plain
    JSON data, with ``"correct": False`` when what it checked was wrong. Every loop in it
    is bounded in count and time.
``limit_s(params: dict) -> float``
    The child's time limit; past it the child (its process group) is ended.
``tables(results: dict, params: dict) -> list[dict]``
    The tables of the record, from ``{"ours": result, "other": result}`` (``other`` only
    with ``--compare``; a side whose child failed is ``{"error": ...}``): each
    ``{"title": str, "columns": [str, ...], "rows": [[cell, ...], ...], "notes": [str]}``
    with cells already formatted as text. ``python -m benches report`` writes them into
    ``docs/benchmarks.md``, and the docs check compares the page with them.

The modules here are the suites and their parts, a part named after its suite: ``core``
(the default session) runs ``core_inprocess``, ``core_views`` and ``core_tcp`` (with
``core_tcp_scenarios`` and ``core_tcp_workers``) as scripts and renders ``core_tables``;
``replay`` runs ``replay_tables`` (and ``replay_peers``), ``sequence`` runs
``sequence_tables`` (with ``sequence_data`` and ``sequence_tcp``); ``peers`` runs
``peers_child`` in each library's interpreter; ``compression`` has
``compression_wire`` and ``compression_tables``, and shares ``compression_common`` with
``sequence-compression``; ``ray`` has ``ray_actors`` and ``ray_tables``; ``params`` has
``params_workers`` (its worker processes and pytrees) and ``params_tables``, and
``params-crowd`` (``params_crowd``) uses the same workers; ``ragged`` runs
``ragged_child`` (with ``ragged_data``, ``ragged_tcp`` for its TCP workers, and ``ragged_tq``
in TransferQueue's virtualenv) once per part, and ``ragged-wire`` (``ragged_wire``) runs
``ragged_tcp``'s rounds with ``compress=`` and a relay. A script runs
on its own as ``python -m benches.suites.NAME`` from the repository root. What every suite
shares is in :mod:`benches.common`.

Adding a suite: write the module (in ``benches/suites``), add one ``Suite`` line to
``SUITES`` below, then ``python -m benches NAME --quick --save`` for its record, a section
with an empty ``<!-- benches:table NAME -->`` / ``<!-- /benches:table -->`` block in
``docs/benchmarks.md``, and ``python -m benches report`` to fill it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Suite:
    name: str
    module: str  # imported only when the suite runs
    description: str

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


# The one place a suite is registered. `core` is the session of benches/suites/core.py; the others
# follow the protocol above.
SUITES: tuple[Suite, ...] = (
    Suite(
        "core",
        "benches.suites.core",
        "raw machine limits, in-process submit/sample, sample() view cost, TCP worker sweep",
    ),
    Suite(
        "accept-flood",
        "benches.suites.accept_flood",
        "accept-and-refuse rate of a full server under a connection flood, vs a plain socket",
    ),
    Suite(
        "torch-handoff",
        "benches.suites.torch_handoff",
        "replay batches into PyTorch CPU tensors (from_numpy, DLPack, device=, copy) vs views",
    ),
    Suite(
        "gil-gap",
        "benches.suites.gil_gap",
        "longest stall of a Python thread while update_priorities holds the replay lock",
    ),
    Suite(
        "rss",
        "benches.suites.rss",
        "RSS over server lifetimes, and the ingress's byte bound with a learner that never samples",
    ),
    Suite(
        "checkpoint-stall",
        "benches.suites.checkpoint_stall",
        "submit/sample latency with and without checkpoints running; write/restore throughput",
    ),
    Suite(
        "wire-versions",
        "benches.suites.wire_versions",
        "samples/s of wire protocol v2 against v1, same client and server",
    ),
    Suite(
        "shm-vs-tcp",
        "benches.suites.shm_vs_tcp",
        "samples/s of the same-host shared-memory path against TCP, K worker processes",
    ),
    Suite(
        "durable",
        "benches.suites.durable",
        "samples/s and worker memory of durable acknowledgements against plain ones, K workers",
    ),
    Suite(
        "params",
        "benches.suites.params",
        "parameters down: 10 MB fetch vs memcpy, loopback TCP and ray.get; sample() p99 while "
        "workers fetch; publish latency",
    ),
    Suite(
        "params-crowd",
        "benches.suites.params_crowd",
        "ingress samples/s while 1,000 connections fetch 1 MB parameters back to back",
    ),
    Suite(
        "socket-settings",
        "benches.suites.socket_settings",
        "loopback samples/s by SO_RCVBUF / SO_SNDBUF / TCP_NODELAY, the ingress's traffic shape",
    ),
    Suite(
        "batch-inserts",
        "benches.suites.batch_inserts",
        "submit_batch / send_batch against one submit / send per row",
    ),
    Suite(
        "replay",
        "benches.suites.replay",
        "replay tables: insert, sample, update_priorities; vs Reverb/TorchRL with --set peers=PY",
    ),
    Suite(
        "metrics",
        "benches.suites.metrics",
        "Prometheus endpoint: scrape CPU with 1,000 TCP workers; small samples with a scraper",
    ),
    Suite(
        "sequence",
        "benches.suites.sequence",
        "sequence tables: windows vs memcpy/numpy/TorchRL, bytes per step, TCP step inserts",
    ),
    Suite(
        "codecs",
        "benches.suites.codecs",
        "zstd-1/3 and LZ4 on real Atari frames: ratio and one-core GB/s per leaf, and when not "
        "to compress",
    ),
    Suite(
        "compression",
        "benches.suites.compression",
        "compressed replay on real Atari steps: RSS, sample and insert rates vs uncompressed, "
        "a zstandard loop and TorchRL, wire compression through a 1 Gb/s relay",
    ),
    Suite(
        "sequence-compression",
        "benches.suites.sequence_compression",
        "compressed sequence tables on real Atari steps: RSS, window sampling and step inserts "
        "vs uncompressed",
    ),
    Suite(
        "peers",
        "benches.suites.peers",
        "echo against cpprb, rlox and id-echo 0.2.1 (each in its own virtualenv): inserts, "
        "uniform/prioritized/Atari/sequence samples",
    ),
    Suite(
        "ragged",
        "benches.suites.ragged",
        "ragged leaves on LLM rollouts: memory vs payload and padding, in-process submit and "
        "16 TCP workers vs a fixed-shape server, packed/padded batches vs memcpy, vs TorchRL "
        "and TransferQueue",
    ),
    Suite(
        "ragged-wire",
        "benches.suites.ragged_wire",
        "ragged rollouts compressed by the workers on the wire vs raw, direct and through a "
        "1 Gb/s link",
    ),
    Suite(
        "ray",
        "benches.suites.ray_service",
        "echo.ray on a local Ray cluster: samples/s by shard count, connect vs TcpClient, "
        "discovery of 256 workers, resume after a learner restart",
    ),
)

BY_NAME = {s.name: s for s in SUITES}
