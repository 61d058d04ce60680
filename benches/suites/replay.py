"""Replay: echo's replay tables through the public Python API, one process, one thread
(``benches/suites/replay_tables.py``): ``submit()`` into an empty prioritized and uniform table
(inserts/s), ``sample()`` of batches from the full tables (batches/s, items/s),
``update_priorities`` (calls/s, keys/s), inserts into a full prioritized table (each evicts)
next to inserts into a FIFO server whose consumer drains it.

With ``--set peers=PYTHON`` (an interpreter with dm-reverb and torchrl installed) the same
sizes run against DeepMind Reverb and TorchRL too (``benches/suites/replay_peers.py``, each
library in its own subprocess), and the record holds their numbers beside ours.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from benches import common as c

LABELS = {
    "fill_prioritized_inserts_per_s": ("fill an empty prioritized table", "inserts/s"),
    "fill_uniform_inserts_per_s": ("fill an empty uniform table", "inserts/s"),
    "sample_prioritized_batches_per_s": ("sample, prioritized", "batches/s"),
    "sample_prioritized_items_per_s": ("sample, prioritized", "items/s"),
    "sample_uniform_batches_per_s": ("sample, uniform", "batches/s"),
    "sample_uniform_items_per_s": ("sample, uniform", "items/s"),
    "update_priorities_calls_per_s": ("update_priorities", "calls/s"),
    "update_priorities_keys_per_s": ("update_priorities", "keys/s"),
    "insert_full_prioritized_per_s": ("insert into a full prioritized table", "inserts/s"),
    "insert_fifo_per_s": ("insert into a FIFO server", "inserts/s"),
}


def parameters(quick: bool) -> dict[str, Any]:
    if quick:
        return {"items": 50_000, "batch": 256, "seconds": 0.5, "peers": None}
    return {"items": 1_000_000, "batch": 256, "seconds": 3.0, "peers": None}


def limit_s(params: dict[str, Any]) -> float:
    return 20 * float(params["seconds"]) + 120.0 + (3600.0 if params["peers"] else 0.0)


def measure(params: dict[str, Any]) -> dict[str, Any]:
    from benches.suites import replay_tables

    args = SimpleNamespace(
        items=int(params["items"]), batch=int(params["batch"]), seconds=float(params["seconds"])
    )
    out: dict[str, Any] = {"echo": replay_tables.bench(args)}
    if params["peers"]:
        out["peers"] = replay_tables.run_peers(str(params["peers"]), args)
    return out


def tables(results: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    columns = ["echo", "operation", "rate", "unit"]
    rows = c.failed_rows(results, len(columns))
    for side, r in results.items():
        for key, value in r.get("echo", {}).items():
            if key in LABELS:
                what, unit = LABELS[key]
                rows.append([side, what, c.num(value), unit])
    out = [
        {
            "title": f"Replay tables of {params['items']:,} items of 40 bytes, batches of "
            f"{params['batch']}, {params['seconds']:g} s per measurement, one thread",
            "columns": columns,
            "rows": rows,
        }
    ]
    peers = results.get("ours", {}).get("peers")
    if peers:
        peer_rows = [
            [lib, section, key, c.num(v.get("inserts_per_s", v.get("batches_per_s")))]
            for lib, r in peers.items()
            if isinstance(r, dict)
            for section in ("fill", "sample")
            for key, v in (r.get(section) or {}).items()
            if isinstance(v, dict)
        ]
        out.append(
            {
                "title": "The peers at the same sizes (inserts/s for fill, batches/s for sample)",
                "columns": ["library", "measurement", "table", "rate"],
                "rows": peer_rows,
            }
        )
    return out
